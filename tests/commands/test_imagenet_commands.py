"""docs/reproducing.md's Table 1 on ImageNet-100, run as written on stand-in data: the sweep (alpha_min
0.6 and 1.0, each pre-training followed by its three evaluations) and its report.

Each fit runs in this process (the sweep's ``run_once``, which starts ``shortcutlab`` in a process
of its own and is run for real by tests/commands/test_sweep_signals.py, is replaced by the same
command's in-process call), so eight fits cost their work, not eight start-ups.

What the test changes, and only that: the data folder points at a generated ImageFolder tree (two of
ImageNet-100's classes, a few 64-pixel JPEGs, ``class_list`` naming those two), every fit runs one
step of a narrow, two-block MAE on 32-pixel crops in fp32 on one CPU process, and the ``lp_mae``
evaluation's own items for 8 GPUs (``batch_size=512``, ``devices=8``, ``accumulate_grad_batches=4``)
are given the CPU's values. The configs, their composition, the evaluations' rebuild of the
pre-trained network from its checkpoint, and the report are the documented ones.
"""
from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import pytest

from helpers import folders
from benchmarks.data_pipeline import write_jpeg_folder
from commands import report, _supervised_run as supervised_run, sweep

ROOT = Path(__file__).resolve().parents[2]
EIGHT_GPU_ITEMS = {"data.init_args.batch_size=512": "data.init_args.batch_size=4", "trainer.devices=8": "trainer.devices=1",
                   "trainer.accumulate_grad_batches=4": "trainer.accumulate_grad_batches=1"}


def documented_commands(marker: str) -> list[list[str]]:
    """The shell block of docs/reproducing.md holding ``marker``: each command's words, after the program."""
    text = (ROOT / "docs" / "reproducing.md").read_text()
    at = text.index(marker)
    start = text.rindex("```bash", 0, at) + len("```bash")
    block = text[start:text.index("```", at)].replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in block.strip().splitlines()]
    commands = [words for words in commands if words and not re.fullmatch(r"[A-Z]+=\S*", words[0])]  # CKPT=...
    assert all(words[0] == ".venv/bin/shortcutlab" for words in commands)
    return [words[1:] for words in commands]


def write_stand_in(root: Path) -> Path:
    """A two-class ImageFolder tree of ImageNet-100's first wnids under ``root`` (4 train and 2 val
    64-pixel JPEGs each) and a class list naming them: its path."""
    wnids = (ROOT / "configs" / "imagenet100_classes.txt").read_text().split()[:2]
    write_jpeg_folder(str(root), per_class=4, names=wnids, val_per_class=2, size=(64, 64))
    (root / "classes.txt").write_text("\n".join(wnids) + "\n")
    return root / "classes.txt"


def one_step(data_dir: Path, epochs: int = 1, one_process: bool = True) -> list[str]:
    """``KEY=VALUE`` settings of a documented fit on the stand-in tree: one fp32 CPU step an epoch
    (``one_process``: in one process, whatever the config's devices and strategy)."""
    settings = [f"data.init_args.data_dir={data_dir}", "data.init_args.image_size=32", "data.init_args.batch_size=4",
                "data.init_args.num_workers=0", "data.init_args.pin_memory=false", "trainer.accelerator=cpu",
                "trainer.precision=32", f"trainer.max_epochs={epochs}", "trainer.limit_train_batches=1",
                "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false", "trainer.accumulate_grad_batches=1"]
    return settings + (["trainer.devices=1", "trainer.strategy=auto"] if one_process else [])


def stand_in_imagenet100(root: Path) -> list[str]:
    """``--set`` items pointing every fit at the stand-in tree, one step each."""
    class_list = write_stand_in(root)
    return [word for setting in [*one_step(root), f"data.init_args.class_list={class_list}"]
            for word in ("--set", setting)]


SMALL_PRETRAINING = ["model.network.embed_dim=32", "model.network.depth=2", "model.network.num_heads=2",
                     "model.network.decoder_embed_dim=32", "model.network.decoder_depth=1",
                     "model.network.decoder_num_heads=2"]


def in_process(args, log, grace=None) -> tuple[int, float]:  # noqa: ANN001 (commands._supervised_run.run_once's)
    """``shortcutlab <args>`` as ``run_once`` runs it, in this process: ``(exit status, seconds)``."""
    from commands import lightning_cli as cli

    start = time.perf_counter()
    try:
        cli.run_reporting_stops(list(args))
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    return status, time.perf_counter() - start


@pytest.mark.slow
def test_table1_on_imagenet100_as_written(tmp_path, monkeypatch, capsys):
    (sweep_args, report_args) = documented_commands("--experiment table1_imagenet100")
    assert sweep_args[0] == "sweep" and report_args == ["report", "runs/table1_imagenet100"]
    sweep_args = [EIGHT_GPU_ITEMS.get(part, part) if "=" in part else part for part in sweep_args[1:]]
    sweep_args = [",".join(EIGHT_GPU_ITEMS.get(item, item) for item in word.split(","))
                  if word.startswith("lp_mae=") else word for word in sweep_args]
    user = tmp_path / "checkout"  # the repository as a user's working folder: configs/ and runs/
    user.mkdir()
    (user / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(user)
    monkeypatch.setenv("PYTHONPATH", folders.PYTHONPATH)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(supervised_run, "run_once", in_process)
    extra = stand_in_imagenet100(tmp_path / "imagenet")
    extra += [word for setting in SMALL_PRETRAINING for word in ("--run-set", setting)]
    records = sweep.main([*sweep_args, *extra])
    printed = capsys.readouterr().out
    assert [r["status"] for r in records] == [0, 0], printed[-3000:]
    for record in records:
        assert {name: e["status"] for name, e in record["evaluations"].items()} == {"ft": 0, "lp": 0, "lp_mae": 0}
        for evaluation in record["evaluations"].values():  # --set reached every evaluation, --run-set none
            command = shlex.split(evaluation["command"])
            assert "--trainer.limit_train_batches=1" in command and "--model.network.depth=2" not in command

    report.main(report_args[1:])
    experiment = user / "runs" / "table1_imagenet100"
    data = json.loads((experiment / "report" / "report.json").read_text())
    assert [g["group"] for g in data["groups"]] == [{"alpha_min": "0.6"}, {"alpha_min": "1.0"}]
    for group in data["groups"]:
        assert group["problems"] == [] and group["n"] == 1
        for column in ("ft/val/top1", "lp/val/top1", "lp_mae/val/top1"):
            assert 0.0 <= group["metrics"][column]["mean"] <= 1.0
    markdown = (experiment / "report" / "report.md").read_text()
    for alpha in ("0.6", "1.0"):
        run = experiment / f"alpha_min={alpha}"
        config = (run / "config.yaml").read_text()
        assert f"alpha_min: {alpha}" in config and "embed_dim: 32" in config
        for name in ("ft", "lp", "lp_mae"):  # each evaluation started from its own run's checkpoint
            started = shlex.split(records[0 if alpha == "0.6" else 1]["evaluations"][name]["command"])
            checkpoint = Path(next(a for a in started if a.startswith("--model.checkpoint=")).split("=", 1)[1])
            assert (user / checkpoint).parent == run / "checkpoints", checkpoint
            assert f"- alpha_min={alpha}/{name}: checkpoints/{checkpoint.name}" in markdown

    for name in ("metrics_vs_alpha_min.png", "effective_rank_over_epochs.png", "probe_vs_effective_rank.png"):
        assert (experiment / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for alpha in ("0.6", "1.0"):  # the FitEndRecord of the sweep's logging fragment ran in each fit
        for fit in ("", "ft", "lp", "lp_mae"):
            assert json.loads((experiment / f"alpha_min={alpha}" / fit / "fit_end.json").read_text())["epochs"] == 1



def cpu_budget(data_dir: Path, epochs: int) -> list[str]:
    """:func:`one_step` as command-line options."""
    return [f"--{setting}" for setting in one_step(data_dir, epochs)]


@pytest.mark.slow
def test_table1_on_imagenet1k_resumed_pre_training_then_its_evaluations(tmp_path, monkeypatch):
    """The ImageNet-1K block as written (pre-training, ``CKPT=`` its folder, fine-tuning, MAE's
    probe), with the pre-training interrupted after one epoch and resumed to two (``--ckpt_path
    auto``, logging on in ``version_0``): both evaluations start from the resumed run's final
    checkpoint, not from the one-epoch one."""
    import torch

    from commands import lightning_cli as cli

    commands = documented_commands("runs/imagenet1k_mae_vit_b16")
    pretraining, finetune, probe = commands  # CKPT=... is a shell assignment, not a command
    text = (ROOT / "docs" / "reproducing.md").read_text()
    ckpt = text[text.index("CKPT=runs/imagenet1k"):].split()[0].split("=", 1)[1]
    user = tmp_path / "checkout"
    user.mkdir()
    (user / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(user)
    data = tmp_path / "imagenet"
    write_jpeg_folder(str(data), per_class=4, names=("n01440764", "n01443537"), val_per_class=2, size=(64, 64))
    small = [f"--{setting}" for setting in SMALL_PRETRAINING]
    stand_in = ["--data.init_args.num_classes=2"]  # ImageNet-1K's 1000 classes: the tree has two
    cli.run_reporting_stops([*pretraining, *small, *stand_in, *cpu_budget(data, epochs=1)])
    cli.run_reporting_stops([*pretraining, *small, *stand_in, *cpu_budget(data, epochs=2), "--ckpt_path=auto"])
    logs = user / ckpt / "lightning_logs"
    assert sorted(p.name for p in logs.iterdir()) == ["version_0"]  # one run, one log folder
    for evaluation in (finetune, probe):
        args = [arg.replace("$CKPT", ckpt) for arg in evaluation]
        assert f"--model.checkpoint={ckpt}" in args
        cli.run_reporting_stops([*args, *stand_in, *cpu_budget(data, epochs=1)])
        root = next(a for a in args if a.startswith("--trainer.default_root_dir=")).split("=", 1)[1]
        (written,) = (user / root).rglob("last.ckpt")
        started = Path(torch.load(written, weights_only=True, map_location="cpu")["hyper_parameters"]["checkpoint"])
        assert started.resolve().is_relative_to((logs / "version_0").resolve()), started
