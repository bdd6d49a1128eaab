"""``make gpu-check`` (docs/multi-gpu.md): its no-CUDA path says so in one
line and exits 0, and the runs it would make are commands the CLI accepts (their configs parse
as given)."""
from __future__ import annotations

import subprocess

import pytest
import torch

from benchmarks import gpu_check
from helpers.composed_configs import resolved_config

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
    config = resolved_config([*args, "--trainer.callbacks+=benchmarks.fit_breakdown.Throughput",
                              f"--trainer.callbacks.path={tmp_path / 'throughput.json'}"])
    assert config["trainer"]["callbacks"][-1]["class_path"] == "benchmarks.fit_breakdown.Throughput"
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


class StandInGPU:
    """The CUDA path without a GPU: ``fit`` and the benchmark subprocess are recorded stand-ins."""

    def __init__(self, monkeypatch, bench=lambda command, timeout: 0):
        self.fits: list[dict] = []
        self.bench_timeouts: list = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(gpu_check, "gpu_name", lambda: "Stand-in GPU 80GB")
        monkeypatch.setattr(gpu_check, "write_imagenet100", lambda root, **kw: root)
        monkeypatch.setattr(gpu_check, "write_cifar100", lambda root, **kw: root)
        monkeypatch.setattr(gpu_check, "fit", self.fit)
        self.breakdown_cases: list = []
        self.breakdown_deadlines: list = []
        monkeypatch.setattr(gpu_check.fit_breakdown, "run_cases", self.breakdown)

        def run(command, cwd, timeout=None):
            self.bench_timeouts.append(timeout)
            return subprocess.CompletedProcess(command, bench(command, timeout))
        monkeypatch.setattr(gpu_check.subprocess, "run", run)

    def breakdown(self, cases, settings, after_case, deadline=None):
        from benchmarks.fit_breakdown import Breakdown, rows

        self.breakdown_cases += cases
        self.breakdown_deadlines.append(deadline)
        out = []
        for case in cases:
            out += rows(Breakdown(case, batch_size=128, steps_per_epoch=100, step=200.0, step_warmup=40, loader=400.0,
                                  peer_loop=160.0 if case.peer else None, bare_fit=180.0, shipped_fit=150.0,
                                  callback_seconds={"EMA": {"per step": 0.032, "per epoch": 0.0}}))
            after_case(out)
        return out

    def fit(self, args, out, steps, precision, devices=1, extra=None, ddp=False):
        self.fits.append({"args": args, "out": out, "steps": steps, "precision": precision, "ddp": ddp})
        decayed = "alpha0.6" in str(out)
        return {"status": 0, "steps": steps, "images_per_s": 90.0 if decayed else 100.0, "peak_memory_gib": 2.0,
                "loss": 0.5 if ddp else 0.51}


def test_every_part_run_writes_one_file_that_says_passed(tmp_path, monkeypatch):
    gpu = StandInGPU(monkeypatch)
    assert gpu_check.main(["--out-dir", str(tmp_path), "--jobs", "3"]) == 0
    text = (tmp_path / "Stand-in-GPU-80GB.md").read_text()
    assert text.rstrip().endswith("every part asked for passed (quick, ddp, paper, breakdown, bench)")
    assert "| ImageNet-100 MAE ViT-B/16 | decayed | ok | 90.0 | 2.00 | 0.900 |" in text
    assert "Run 3 at a time" in text
    # 8 quick fits, the DDP pair, 4 paper fits; the DDP run is under strategy=ddp also on one GPU
    assert len(gpu.fits) == 14 and [f["out"].name for f in gpu.fits if f["ddp"]] == ["ddp-n"]
    assert "ok: 1 GPU(s) under DDP" in text and "0.5000 against 0.5100" in text
    # the breakdown: both paper configs (decayed) on data of 100 steps an epoch; fractions of the step
    decayed = [gpu_check.composition(rows[0]) for rows in gpu_check.PAPER.values()]
    imagenet, on_gpu, cifar = gpu.breakdown_cases
    assert [imagenet.fit_args[:len(decayed[0])], cifar.fit_args[:len(decayed[1])]] == decayed
    assert on_gpu.fit_args == imagenet.fit_args + ["--data.init_args.decoder=gpu"] and on_gpu.fits == ("none", "shipped")
    assert (imagenet.peer, on_gpu.peer, cifar.peer) == ("mae", None, "uvit")  # each paper config against its own loop
    assert "| the official recipe's own training loop (facebookresearch/mae) | 160.0 | 0.800 |" in text
    assert "| the fit as shipped | 150.0 | 0.750 | 150.0 img/s; 0.94x the official loop |" in text
    assert "| callback EMA | - | 5.0 % of a step | 32.00 ms a step" in text  # 0.032 s against 128 / 200 img/s = 0.64 s


def test_a_run_stopped_part_way_leaves_the_parts_it_finished(tmp_path, monkeypatch):
    gpu = StandInGPU(monkeypatch)
    seen = []

    def stop_in_the_paper_part(args, out, *rest, **kwargs):
        if "alpha" in str(out):
            seen.append((tmp_path / "Stand-in-GPU-80GB.md").read_text())
            raise KeyboardInterrupt  # as a time limit's kill would end it
        return StandInGPU.fit(gpu, args, out, *rest, **kwargs)
    monkeypatch.setattr(gpu_check, "fit", stop_in_the_paper_part)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--out-dir", str(tmp_path)])
    text = (tmp_path / "Stand-in-GPU-80GB.md").read_text()
    assert seen == [text]
    assert "| MAE | bf16-mixed | ok | 300 |" in text and "ok: 1 GPU(s) under DDP" in text
    assert "| ImageNet-100 MAE ViT-B/16 | decayed | not run |" in text
    assert text.rstrip().endswith('not finished: the figures marked "not run" were not reached')


def test_a_subset_of_parts_writes_its_own_file_of_those_parts_alone(tmp_path, monkeypatch):
    gpu = StandInGPU(monkeypatch)
    assert gpu_check.main(["--out-dir", str(tmp_path), "--parts", "paper"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["Stand-in-GPU-80GB-paper.md"]
    text = (tmp_path / "Stand-in-GPU-80GB-paper.md").read_text()
    assert "## Paper configs" in text and "## Quick configs" not in text and "## DDP" not in text
    assert text.rstrip().endswith("every part asked for passed (paper)")
    assert {f["out"].name for f in gpu.fits} == {row for rows in gpu_check.PAPER.values() for row in rows}
    assert gpu.bench_timeouts == []


@pytest.mark.parametrize("limit, bench, expected", [
    (None, lambda command, timeout: 0, "`python -m benchmarks --device cuda --precision bf16-mixed --rounds 2`: ok"),
    (50.0, lambda command, timeout: 0, "`: not run ("),
    (1000.0, lambda command, timeout: (_ for _ in ()).throw(subprocess.TimeoutExpired(command, timeout)),
     "FAIL: stopped at the time limit after"),
    (None, lambda command, timeout: 2, "FAIL (exit status 2)")])
def test_the_benchmark_part_keeps_to_the_time_limit(limit, bench, expected, tmp_path, monkeypatch):
    gpu = StandInGPU(monkeypatch, bench=bench)
    args = ["--out-dir", str(tmp_path), "--parts", "bench", "--bench-args", "--rounds 2"]
    status = gpu_check.main(args + ([] if limit is None else ["--time-limit-s", str(limit)]))
    text = (tmp_path / "Stand-in-GPU-80GB-bench.md").read_text()
    assert expected in text and status == (0 if expected.endswith(": ok") else 1)
    if limit == 1000.0:
        assert 960 < gpu.bench_timeouts[0] <= 970  # the limit less the 30 s kept to write the results
    if limit == 50.0:
        assert gpu.bench_timeouts == []


def test_fit_puts_only_the_ddp_run_under_ddp(tmp_path, monkeypatch):
    commands = []
    monkeypatch.setattr(gpu_check.fit_breakdown.subprocess, "run", lambda command, **kw: commands.append(command) or
                        subprocess.CompletedProcess(command, 0, "", ""))
    gpu_check.fit(["--config=x.yaml"], tmp_path, 10, "32-true")
    gpu_check.fit(["--config=x.yaml"], tmp_path, 10, "32-true", devices=1, ddp=True)
    assert ["--trainer.strategy=ddp" in c for c in commands] == [False, True]
    assert "--trainer.devices=1" in commands[1]


def test_the_results_file_links_the_benchmark_table_only_once_it_exists(tmp_path, monkeypatch):
    StandInGPU(monkeypatch)
    gpu_check.main(["--out-dir", str(tmp_path), "--parts", "quick"])
    assert "benchmarks.md" not in (tmp_path / "Stand-in-GPU-80GB-quick.md").read_text()
    (tmp_path / "Stand-in-GPU-80GB-bench-benchmarks.md").write_text("| table |")
    gpu_check.main(["--out-dir", str(tmp_path), "--parts", "bench"])
    assert "[Stand-in-GPU-80GB-bench-benchmarks.md](Stand-in-GPU-80GB-bench-benchmarks.md)" in \
        (tmp_path / "Stand-in-GPU-80GB-bench.md").read_text()


def test_results_go_to_a_scratch_folder_unless_the_shipped_ones_are_asked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "SCRATCH", tmp_path / "scratch")
    monkeypatch.setattr(gpu_check, "SHIPPED", tmp_path / "shipped")
    assert gpu_check.parse([]).out_dir == tmp_path / "scratch"
    assert gpu_check.parse(["--update-docs"]).out_dir == tmp_path / "shipped"
    assert gpu_check.parse(["--out-dir", str(tmp_path / "mine")]).out_dir == tmp_path / "mine"
    with pytest.raises(SystemExit):
        gpu_check.parse(["--update-docs", "--out-dir", str(tmp_path)])
    StandInGPU(monkeypatch)
    gpu_check.main(["--parts", "quick"])
    assert [p.name for p in (tmp_path / "scratch").iterdir()] == ["Stand-in-GPU-80GB-quick.md"]
    assert not (tmp_path / "shipped").exists()


def test_the_breakdown_keeps_to_the_time_limit(tmp_path, monkeypatch):
    import time

    gpu = StandInGPU(monkeypatch)
    assert gpu_check.main(["--out-dir", str(tmp_path), "--parts", "breakdown"]) == 0
    before = time.monotonic()
    assert gpu_check.main(["--out-dir", str(tmp_path), "--parts", "breakdown", "--time-limit-s", "1000"]) == 0
    unbounded, bounded = gpu.breakdown_deadlines
    assert unbounded is None and before + 960 < bounded <= time.monotonic() + 970  # less 30 s to write the results
