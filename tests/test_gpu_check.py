"""``make gpu-check`` (issue 18, item 6; docs/multi-gpu.md): its no-CUDA path says so in one
line and exits 0, and the runs it would make are commands the CLI accepts (their configs parse
as given)."""
from __future__ import annotations

import subprocess

import pytest
import torch

from benchmarks import gpu_check
from composed_configs import resolved_config

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


def test_without_cuda_one_line_and_status_0(tmp_path):
    done = subprocess.run(["make", "-s", "gpu-check", f"ARGS=--out-dir {tmp_path}"], cwd=gpu_check.REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines() == [
        "gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing run"]
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("args", [*gpu_check.QUICK.values(),
                                  *[gpu_check.composition(row) for rows in gpu_check.PAPER.values() for row in rows]],
                         ids=[*gpu_check.QUICK, *[row for rows in gpu_check.PAPER.values() for row in rows]])
def test_every_run_it_makes_is_a_config_the_cli_parses(args, tmp_path, monkeypatch):
    monkeypatch.chdir(gpu_check.REPO)
    config = resolved_config([*args, "--trainer.callbacks+=benchmarks.gpu_check.Throughput",
                              f"--trainer.callbacks.path={tmp_path / 'throughput.json'}"])
    assert config["trainer"]["callbacks"][-1]["class_path"] == "benchmarks.gpu_check.Throughput"
    assert config["model"]["class_path"].startswith("lightning_mods.")


def test_generated_paper_data_loads_in_the_real_datamodules(tmp_path):
    from datamodules.imagenet import ImageNet
    from datamodules.torchvision_sets import CIFAR100

    gpu_check.write_imagenet100(tmp_path / "in100", per_class=1)
    imagenet = ImageNet(data_dir=str(tmp_path / "in100"), class_list=str(gpu_check.REPO / "configs" /
                                                                          "imagenet100_classes.txt"))
    imagenet.setup("fit")
    image, label = imagenet.train_dataset[0]
    assert image.shape == (3, 224, 224) and len(imagenet.train_dataset) == 100
    gpu_check.write_cifar100(tmp_path / "c100", n_train=8, n_test=4)
    cifar = CIFAR100(data_dir=str(tmp_path / "c100"), download=False)
    cifar.setup("fit")
    assert cifar.train_dataset[0][0].shape == (3, 32, 32)
