"""ImageNet's loader workers when the config sets none: the cores this process may run on, shared by
the training processes of the host, less one for each process itself, capped (hand-computed cases);
a value the config sets is kept."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.data_pipeline import write_jpeg_folder
from datamodules import imagenet


@pytest.mark.parametrize(("cores", "processes", "workers"),
                         [(16, 1, 15), (16, 8, 1), (2, 1, 1), (1, 1, 0), (96, 8, 11), (128, 1, 16)])
def test_workers_from_the_host_s_cores(monkeypatch, cores, processes, workers):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setattr(imagenet.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert imagenet.host_workers(processes) == workers


def test_a_slurm_task_takes_its_own_cpus(monkeypatch):
    """--cpus-per-task=11 with 8 tasks a node: 10 workers each (the task's cores, not a share)."""
    monkeypatch.setattr(imagenet.os, "sched_getaffinity", lambda pid: set(range(11)), raising=False)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "11")
    assert imagenet.host_workers(8) == 10


def test_setup_takes_them_from_the_trainer_s_devices_unless_set(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    write_jpeg_folder(str(tmp_path), per_class=2)
    monkeypatch.setattr(imagenet.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    data = imagenet.ImageNet(data_dir=str(tmp_path), num_classes=2)
    data.trainer = SimpleNamespace(num_devices=4)
    data.setup("fit")
    assert data.num_workers == 3
    chosen = imagenet.ImageNet(data_dir=str(tmp_path), num_classes=2, num_workers=2)
    chosen.setup("fit")
    assert chosen.num_workers == 2
