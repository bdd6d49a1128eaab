"""Every bad input of docs/reliability.md's "Bad input" table: exit status 2, one line on stderr naming
the field or file, and the run folder exactly as it was.

Most cases call ``cli.console_main`` in-process with ``sys.argv`` patched (what the console
script runs); a corrupt image, found inside a DataLoader worker after Lightning has set the
seed and created the log folder, runs the installed ``shortcutlab`` command in a subprocess.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from commands import lightning_cli as cli
from conftest import make_imagefolder
from datamodules.imagenet import CorruptImageError, ImageNet
from test_cli import TINY_MAE

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--trainer.fast_dev_run=1", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false"]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder``, with size and modification time for files."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else "folder"
            for p in sorted(folder.rglob("*"))}


@pytest.fixture()
def run_folder(tmp_path) -> Path:
    """A run folder holding an earlier run's log and checkpoint (which must survive untouched)."""
    earlier = tmp_path / "run" / "lightning_logs" / "version_0"
    (earlier / "checkpoints").mkdir(parents=True)
    (earlier / "metrics.csv").write_text("epoch,val/loss\n0,1.0\n")
    torch.save({"state_dict": {}}, earlier / "checkpoints" / "last.ckpt")
    return tmp_path / "run"


@pytest.fixture()
def bad_files(tmp_path) -> dict[str, Path]:
    class WritesAFile:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    good = tmp_path / "weights.pt"
    torch.save({"weights": torch.zeros(2)}, good)
    raw = good.read_bytes()
    files = {"truncated": raw[: len(raw) // 2], "empty": b"", "text": b"not a checkpoint at all",
             "pickled-code": pickle.dumps({"state_dict": {}, "x": WritesAFile()}, protocol=2)}
    paths = {name: tmp_path / f"{name}.ckpt" for name in files}
    for name, content in files.items():
        paths[name].write_bytes(content)
    paths["not-lightning"] = good
    paths["missing"] = tmp_path / "missing.ckpt"
    cfg = tmp_path / "unknown_key.yaml"
    cfg.write_text("model:\n  init_args:\n    network:\n      init_args:\n        shortcut:\n          init_args:\n            alpha_mni: 0.5\n")
    paths["unknown-yaml"] = cfg
    cfg = tmp_path / "unknown_trainer_key.yaml"
    cfg.write_text("trainer:\n  max_epcohs: 3\n")
    paths["unknown-yaml-trainer"] = cfg
    return paths


def run_console(monkeypatch, capsys, argv: list[str]) -> tuple[int, list[str]]:
    monkeypatch.setattr(sys, "argv", ["shortcutlab", *argv])
    monkeypatch.setattr(cli, "info_logs_to_stdout", lambda: None)  # keep pytest's log handlers as they are
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.console_main()
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()


CONFIG = [f"--config={ROOT / 'configs' / 'digits_mae.yaml'}"]
SHORTCUT = "--model.init_args.network.init_args.shortcut.init_args"
CASES = {  # name: (arguments, words the one line must hold)
    "invalid choice": ([*CONFIG, f"{SHORTCUT}.kind=foo"],
                       ["model.init_args.network.init_args.shortcut.init_args.kind: must be one of", "'linear'", "got 'foo'"]),
    "nan": ([*CONFIG, f"{SHORTCUT}.alpha_min=nan"],
            ["model.init_args.network.init_args.shortcut.init_args.alpha_min: must be of type finite float; got 'nan'"]),
    "yaml nan": ([*CONFIG, f"{SHORTCUT}.alpha_min=.nan"], ["alpha_min must be a finite number in [0, 1], got nan"]),
    "unknown key": ([*CONFIG, "--model.network.embed_dimm=3"],
                    ["model.init_args.network.init_args.embed_dimm: unknown key of "
                     "lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT",
                     "did you mean 'model.init_args.network.init_args.embed_dim'?"]),
    "a network setting of the recipe": ([*CONFIG, "--model.init_args.embed_dim=3"],
                                        ["model.init_args.embed_dim: unknown key of lightning_mods.mae.MaskedAutoencoder",
                                         "a setting of its network is model.init_args.network.init_args.embed_dim"]),
    # a key neither the recipe nor its network takes: no hint that the network would (it refuses it too)
    "a key of nothing": ([*CONFIG, "--model.init_args.bogus_key=1"],
                         ["model.init_args.bogus_key: unknown key of lightning_mods.mae.MaskedAutoencoder"]),
    "unknown option": ([*CONFIG, "--trainer.max_epcohs=3"],
                       ["unknown option '--trainer.max_epcohs'; did you mean '--trainer.max_epochs'?"]),
    "unknown yaml key": ([*CONFIG, "--config={unknown-yaml}"],
                         ["model.init_args.network.init_args.shortcut.init_args.alpha_mni: unknown key",
                          "did you mean 'model.init_args.network.init_args.shortcut.init_args.alpha_min'?"]),
    "unknown yaml trainer key": ([*CONFIG, "--config={unknown-yaml-trainer}"],
                                 ["trainer.max_epcohs: unknown key; did you mean 'trainer.max_epochs'?"]),
    "missing config": (["--config={missing}"], ["config: file does not exist", "missing.ckpt"]),
    "negative epochs": ([*CONFIG, "--trainer.max_epochs=-5"], ["max_epochs", "-5"]),
    **{f"{name} checkpoint": ([*CONFIG, f"--ckpt_path={{{name}}}"], ["ckpt_path: '{%s}'" % name, words])
       for name, words in (("truncated", "truncated or corrupted zip archive"), ("empty", "empty or truncated file"),
                           ("text", "not a torch checkpoint; the weights-only loader refused it"),
                           ("pickled-code", "it refers to getattr, which a checkpoint never holds; refused without running it"),
                           ("not-lightning", "not a Lightning checkpoint"))},
    "missing checkpoint": ([*CONFIG, "--ckpt_path={missing}"], ["ckpt_path: no file at '{missing}'"]),
    "alias checkpoint": ([*CONFIG, "--ckpt_path=last"], ["ckpt_path: give the checkpoint's file path",
                                                         "not Lightning's alias 'last'"]),
    "url checkpoint": ([*CONFIG, "--ckpt_path=s3://bucket/last.ckpt"],
                       ["ckpt_path: a local file is needed, got the URL 's3://bucket/last.ckpt'"]),
    # a setting the data links in would be replaced silently
    "image size against the data": ([*CONFIG, "--model.network.img_size=32"],
                                    ["model.network.img_size=32 disagrees with the data's image_size (16; Digits)"]),
    "the MAE network's image_size": ([*CONFIG, "--model.network.image_size=32"],
                                     ["model.init_args.network.init_args.image_size: unknown key of "
                                      "lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT; it is "
                                      "model.init_args.network.init_args.img_size since release 0.3"]),
    "class count against the data": ([f"--config={ROOT / 'configs' / 'data' / 'digits.yaml'}",
                                      f"--config={ROOT / 'configs' / 'digits_resnet' / 'base.yaml'}",
                                      "--model.init_args.num_classes=5"],
                                     ["model.num_classes=5 disagrees with the data's num_classes (10; Digits)"]),
    # a setting renamed when the network a training recipe trains got one name, network
    "the classifier's backbone": ([f"--config={ROOT / 'configs' / 'data' / 'digits.yaml'}",
                                   f"--config={ROOT / 'configs' / 'digits_resnet' / 'base.yaml'}",
                                   "--model.backbone.shortcut.alpha_min=0.8"],
                                  ["model.init_args.backbone: unknown key of lightning_mods.classifier.ImageClassifier; "
                                   "it is model.init_args.network since release 0.3 (--model.network.shortcut.alpha_min)"]),
    "fine-tuning's encoder override": ([f"--config={ROOT / 'configs' / 'finetune_digits.yaml'}",
                                        "--model.init_args.allow_encoder_override=true"],
                                       ["model.init_args.allow_encoder_override: unknown key of "
                                        "lightning_mods.finetune.FineTuneClassifier; it is "
                                        "model.init_args.allow_override since release 0.3"]),
    "the probe's backbone override": ([f"--config={ROOT / 'configs' / 'linear_probe_digits.yaml'}",
                                       "--model.allow_backbone_override=true"],
                                      ["model.init_args.allow_backbone_override: unknown key of "
                                       "lightning_mods.linear_probe.LinearProbe; it is "
                                       "model.init_args.allow_override since release 0.3"]),
    "the online probe's flat settings": ([*CONFIG, "--trainer.callbacks+=OnlineLinearProbe",
                                          "--trainer.callbacks.replay_samples=64"],
                                         ["replay_samples: unknown key of "
                                          "callbacks.measurement.online_probe.OnlineLinearProbe; it is "
                                          "trainer.callbacks.init_args.replay.samples since release 0.3"]),
    "missing pre-trained file": ([f"--config={ROOT / 'configs' / 'finetune_digits.yaml'}",
                                  "--model.init_args.checkpoint={missing}"], ["checkpoint: no file at '{missing}'"]),
}


# settings parse alike for every subcommand; a checkpoint is read by fit and by validate
RUNS = [(case, "fit") for case in CASES] + [(case, "validate") for case in CASES if "checkpoint" in case]


@pytest.mark.parametrize("case, subcommand", RUNS)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, subcommand, run_folder, bad_files, monkeypatch,
                                                          capsys):
    args, expected = CASES[case]
    fill = {name: str(path) for name, path in bad_files.items()}
    args = [a.format(**fill) for a in args]
    before = snapshot(run_folder)
    code, lines = run_console(monkeypatch, capsys, [subcommand, *args, *FAST,
                                                    f"--trainer.default_root_dir={run_folder}"])
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("shortcutlab: error: "), lines
    for words in expected:
        assert words.format(**fill) in lines[0]
    assert snapshot(run_folder) == before
    assert not (bad_files["pickled-code"].parent / "pwned").exists()


def shortcutlab(command: list[str], *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``command ARGS`` as a user runs it (``command``: the warm CLI's, tests/helpers/fork_server.py)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SHORTCUTLAB_TRACEBACK", None)
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_corrupt_image_found_by_a_loader_worker_is_one_line_and_leaves_no_log(tmp_path, run_folder, warm_shortcutlab):
    """The image is only opened inside the DataLoader worker, after Lightning has created the
    run's log folder: the error still arrives as one line (after any warnings Lightning gave),
    the new folder is removed, and Lightning's info lines went to stdout."""
    written = make_imagefolder(tmp_path / "imagenet", ["a", "b"], n_per_class=2, size=(16, 16))
    bad = written["val"][0][0]
    bad.write_bytes(b"")
    before = snapshot(run_folder)
    out = shortcutlab(warm_shortcutlab, "fit", "--seed_everything=0", *TINY_MAE, "--data=datamodules.imagenet.ImageNet",
                      f"--data.init_args.data_dir={tmp_path / 'imagenet'}", "--data.init_args.num_classes=2",
                      "--data.init_args.image_size=16", "--data.init_args.batch_size=2",
                      "--data.init_args.num_workers=1", "--trainer.max_epochs=1", "--trainer.accelerator=cpu",
                      "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={run_folder}")
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("shortcutlab: error:")]
    assert errors == [out.stderr.strip().splitlines()[-1]] and "Traceback" not in out.stderr
    assert f"ImageNet: cannot read image '{bad}'" in errors[0]
    assert "(empty file); set data.init_args.skip_corrupt=true" in errors[0]
    assert "Seed set to 0" in out.stdout and "Seed set to 0" not in out.stderr
    assert snapshot(run_folder) == before


@pytest.mark.parametrize("damage", ["zero-byte", "garbage", "truncated"])
def test_imagenet_names_the_unreadable_file_or_skips_it_on_request(tmp_path, damage):
    written = make_imagefolder(tmp_path, ["a", "b"], n_per_class=3, size=(16, 16), splits=("val",))
    bad, next_path = written["val"][1][0], written["val"][2][0]  # a_1.JPEG, then a_2.JPEG
    data = bad.read_bytes()
    bad.write_bytes({"zero-byte": b"", "garbage": b"\xff\xd8\xff not a jpeg", "truncated": data[: len(data) // 2]}[damage])
    strict = ImageNet(data_dir=str(tmp_path), num_classes=2, image_size=16)
    strict.classes = ["a", "b"]
    with pytest.raises(CorruptImageError, match=f"ImageNet: cannot read image '{bad}'") as err:
        strict.load_split(train=False)[1]
    assert "\n" not in str(err.value)
    skipping = ImageNet(data_dir=str(tmp_path), num_classes=2, image_size=16, skip_corrupt=True)
    skipping.classes = ["a", "b"]
    samples = skipping.load_split(train=False)
    with pytest.warns(UserWarning, match=f"cannot read image '{bad}'.*skipped, using the next readable image"):
        image, label = samples[1]
    assert len(samples) == 6 and label == 0
    assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8  # torchvision's decoder, the default
    decoded = np.asarray(image.permute(1, 2, 0))
    assert np.abs(decoded.astype(int) - np.asarray(Image.open(next_path).convert("RGB")).astype(int)).max() <= 1
    with_pil = ImageNet(data_dir=str(tmp_path), num_classes=2, image_size=16, skip_corrupt=True, decoder="pil")
    with_pil.classes = ["a", "b"]
    with pytest.warns(UserWarning, match=f"cannot read image '{bad}'"):
        image, _ = with_pil.load_split(train=False)[1]
    assert np.array_equal(np.asarray(image), np.asarray(Image.open(next_path).convert("RGB")))


@pytest.mark.parametrize("config", ["linear_probe_digits.yaml", "finetune_digits.yaml"])
def test_an_evaluation_of_a_checkpoint_at_another_image_size_is_one_line_and_writes_nothing(
        config, tmp_path, run_folder, monkeypatch, capsys):
    """The probe and fine-tuning check the data's images against the checkpoint's network before
    the first batch (a 32-pixel probe of a 16-pixel MAE stopped with an 83-line traceback)."""
    from test_cli import run_fit

    checkpoint = run_fit(tmp_path / "pre-training")  # the digits at 16 pixels, one channel
    before = snapshot(run_folder)
    code, lines = run_console(monkeypatch, capsys, ["fit", f"--config={ROOT / 'configs' / config}",
                                                    f"--model.checkpoint={checkpoint}", "--data.init_args.image_size=32",
                                                    *FAST, f"--trainer.default_root_dir={run_folder}"])
    assert code == 2 and len(lines) == 1, lines
    assert "the data gives 32-pixel images where the network takes 16 (data.init_args.image_size=16)" in lines[0]
    assert snapshot(run_folder) == before


def imagenet100_ddp_fit(monkeypatch, capsys, data_dir: Path, run_dir: Path) -> tuple[int, list[str]]:
    """``shortcutlab fit`` of a small MAE on configs/data/imagenet100.yaml with ``data_dir``, two DDP
    processes on the CPU: its exit status and stderr lines."""
    small = ["--model.network.depth=2", "--model.network.embed_dim=32", "--model.network.num_heads=2",
             "--model.network.decoder_embed_dim=16", "--model.network.decoder_depth=1",
             "--model.network.decoder_num_heads=2"]
    monkeypatch.chdir(ROOT)  # the config's class list is a path in the checkout
    return run_console(monkeypatch, capsys, [
        "fit", "--config=configs/data/imagenet100.yaml", "--config=configs/mae/base.yaml", *small,
        f"--data.init_args.data_dir={data_dir}", "--trainer.accelerator=cpu", "--trainer.devices=2",
        "--trainer.strategy=ddp", "--trainer.precision=32-true", f"--trainer.default_root_dir={run_dir}"])


def test_a_wrong_data_dir_is_found_before_any_process_starts(tmp_path, monkeypatch, capsys):
    """A DDP fit of ImageNet with a data_dir that holds no ImageNet: one line from the launching
    process, before Lightning starts the others (each would print it, after its own start-up)."""
    code, lines = imagenet100_ddp_fit(monkeypatch, capsys, tmp_path / "not_imagenet", tmp_path / "run")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (f"shortcutlab: error: ImageNet: no class folders under '{tmp_path / 'not_imagenet' / 'train'}' "
                        "(expected data_dir/train/<wnid>/<image> and data_dir/val/<wnid>/<image>); set data_dir")
    assert not (tmp_path / "run").exists()  # no process started, no log folder left


def test_the_network_hint_names_only_a_key_the_network_takes():
    """An unknown recipe key is pointed at the network only when a network of the recipe takes it."""
    from commands.cli_output import network_takes

    assert network_takes("lightning_mods.mae.MaskedAutoencoder", "embed_dim")
    assert network_takes("lightning_mods.diffusion.DiffusionModule", "img_size")
    assert not network_takes("lightning_mods.mae.MaskedAutoencoder", "bogus_key")
    assert not network_takes("lightning_mods.classifier.ImageClassifier", "embed_dim")  # no network argument
