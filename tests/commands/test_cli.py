"""The shortcutlab CLI end to end on the digits: fit, validate from a checkpoint, the
LinearProbe on an MAE checkpoint, the console command, and one-line errors."""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import TQDMProgressBar

from commands import cli_output as console
from commands import lightning_cli as cli
from lightning_mods.linear_probe import LinearProbe, load_checkpoint_state_dict
from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT

ROOT = Path(__file__).resolve().parents[2]
TINY_MAE = ["--model=lightning_mods.mae.MaskedAutoencoder",
            "--model.network=lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT",
            "--model.network.patch_size=8", "--model.network.embed_dim=32", "--model.network.depth=4",
            "--model.network.num_heads=2", "--model.network.decoder_embed_dim=16", "--model.network.decoder_depth=2",
            "--model.network.decoder_num_heads=2", "--model.init_args.num_reconstructions=4"]
DIGITS = ["--data=datamodules.digits.Digits", "--data.init_args.batch_size=32",
          "--data.init_args.image_size=16"]  # the quickstart's geometry (configs/digits_mae.yaml)


def run_fit(tmp_path: Path, *extra: str) -> Path:
    args = ["fit", *TINY_MAE, *DIGITS, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
            "--trainer.limit_val_batches=1",
            "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.init_args.save_dir={tmp_path}", *extra]
    cli.main(args)
    ckpts = sorted(tmp_path.rglob("*.ckpt"))
    assert ckpts, "fit wrote no checkpoint"
    return ckpts[-1]


@pytest.fixture(scope="module")
def mae_checkpoint(tmp_path_factory) -> Path:
    return run_fit(tmp_path_factory.mktemp("fit"))


def test_links_image_geometry_from_the_datamodule(mae_checkpoint):
    ckpt = torch.load(mae_checkpoint, map_location="cpu", weights_only=True)
    hp = ckpt["hyper_parameters"]["network"]["init_args"]  # the recipe records its network's settings
    assert hp["in_chans"] == 1 and hp["img_size"] == 16
    assert hp["shortcut"]["alpha_min"] == 0.6  # the paper's default schedule


def test_fit_writes_reconstruction_pictures(mae_checkpoint):
    pictures = list(mae_checkpoint.parents[1].rglob("pictures/mae_reconstructions_step*.png"))
    assert pictures, "no reconstruction picture was written"


def test_validate_from_checkpoint(mae_checkpoint, tmp_path):
    out = cli.main(["validate", *TINY_MAE, *DIGITS, f"--ckpt_path={mae_checkpoint}", "--trainer.accelerator=cpu",
                    "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=2",
                    f"--trainer.default_root_dir={tmp_path}"])
    assert "val/loss" in out.trainer.callback_metrics


def test_linear_probe_loads_the_mae_checkpoint(mae_checkpoint):
    state = load_checkpoint_state_dict(mae_checkpoint)
    backbone = MaskedAutoencoder(MaskedAutoencoderViT(img_size=16, in_chans=1, patch_size=8, embed_dim=32, depth=4, num_heads=2, decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2))
    probe = LinearProbe(backbone, checkpoint=str(mae_checkpoint), num_classes=10)
    assert probe.backbone is backbone.network  # the probe holds the network alone
    for name, value in state.items():
        torch.testing.assert_close(probe.backbone.state_dict()[name.removeprefix("network.")], value, rtol=0, atol=0)
    assert not any(p.requires_grad for p in probe.backbone.parameters())
    probe.train()
    assert not probe.backbone.training  # frozen backbone stays in eval mode


def test_linear_probe_fit_through_the_cli(mae_checkpoint, tmp_path):
    out = cli.main(["fit", f"--config={ROOT / 'configs' / 'linear_probe_digits.yaml'}",
                    f"--model.init_args.checkpoint={mae_checkpoint}",  # the architecture comes from it
                    "--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1",
                    "--trainer.enable_progress_bar=false",
                    f"--trainer.default_root_dir={tmp_path}"])
    assert {"val/top1", "val/top5"} <= set(out.trainer.callback_metrics)


def test_linear_probe_refuses_a_checkpoint_of_another_geometry(mae_checkpoint):
    other = MaskedAutoencoder(MaskedAutoencoderViT(img_size=32, in_chans=1, patch_size=8, embed_dim=32, depth=4, num_heads=2, decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2))
    with pytest.raises(ValueError, match=r"checkpoint: .* does not fit the MaskedAutoencoder: .*pos_embed is \(1, 5, 32\) "
                                         r"there and \(1, 17, 32\) here") as err:
        LinearProbe(other, checkpoint=str(mae_checkpoint), num_classes=10)
    assert "\n" not in str(err.value)
    shallow = MaskedAutoencoder(MaskedAutoencoderViT(img_size=16, in_chans=1, patch_size=8, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2))
    with pytest.raises(ValueError, match="unexpected network.encoder.blocks.2"):
        LinearProbe(shallow, checkpoint=str(mae_checkpoint), num_classes=10)


@pytest.mark.parametrize("content", [b"not a checkpoint at all", b""])
def test_linear_probe_refuses_a_file_that_is_not_a_checkpoint(tmp_path, content):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=r"checkpoint: .*bad\.ckpt.* is not a loadable torch checkpoint") as err:
        load_checkpoint_state_dict(bad)
    assert "\n" not in str(err.value)


def test_linear_probe_refuses_a_torch_file_without_state_dict(tmp_path):
    other = tmp_path / "weights.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    with pytest.raises(ValueError, match="has no 'state_dict'"):
        load_checkpoint_state_dict(other)
    with pytest.raises(FileNotFoundError, match="checkpoint: no file"):
        load_checkpoint_state_dict(tmp_path / "missing.ckpt")


def test_linear_probe_refuses_a_pickle_with_code(tmp_path):
    """weights_only loading: a pickle that would run code is refused, not executed."""
    import pickle

    class Evil:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    evil = tmp_path / "evil.ckpt"
    evil.write_bytes(pickle.dumps({"state_dict": {}, "x": Evil()}))
    with pytest.raises(ValueError, match="not a loadable torch checkpoint"):
        load_checkpoint_state_dict(evil)
    assert not (tmp_path / "pwned").exists()


def test_bad_shortcut_value_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError) as err:
        cli.main(["fit", *TINY_MAE, *DIGITS, "--model.network.shortcut.alpha_min=1.5",
                  "--trainer.fast_dev_run=1", f"--trainer.default_root_dir={tmp_path}"])
    assert cli.root_message(err.value) == "alpha_min must be a finite number in [0, 1], got 1.5"
    exe = Path(sys.executable).with_name("shortcutlab")
    out = subprocess.run([str(exe), "fit", *TINY_MAE, *DIGITS, "--model.network.shortcut.alpha_min=1.5",
                          "--trainer.fast_dev_run=1", f"--trainer.default_root_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == \
        "shortcutlab: error: alpha_min must be a finite number in [0, 1], got 1.5"
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize("text, where", [("trainer:\n  max_epochs: 1\n  devices: [1, 2\nmodel: x\n", "line 4, column 6"),
                                         ("model: x: y\n", "line 1, column 9")])
def test_a_config_that_is_not_yaml_is_named_with_its_line(tmp_path, text, where):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    for args in (["fit", "--config", "configs/digits_mae.yaml", "--config", str(bad)], ["fit", f"--config={bad}"]):
        with pytest.raises(ValueError) as err:
            cli.main(args + [f"--trainer.default_root_dir={tmp_path}"], parser_kwargs=cli.raising_parsers())
        assert cli.root_message(err.value).startswith(f"{bad}, {where}: not valid YAML ("), cli.root_message(err.value)


@pytest.mark.parametrize("setting, message", [
    ("--model.network.num_heads=5", "num_heads (5) must divide embed_dim (96)"),
    ("--model.network.decoder_num_heads=3", "decoder_num_heads (3) must divide decoder_embed_dim (64)")])
def test_heads_that_do_not_divide_the_width_name_both_settings(tmp_path, setting, message):
    with pytest.raises(ValueError) as err:
        cli.main(["fit", "--config", "configs/digits_mae.yaml", setting, "--trainer.fast_dev_run=1",
                  f"--trainer.default_root_dir={tmp_path}"])
    assert cli.root_message(err.value).startswith(message + ": "), cli.root_message(err.value)


def test_bf16_on_cpu_without_amx_warns(monkeypatch):
    monkeypatch.setattr(console, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(UserWarning, match="precision='bf16-mixed'"):
        cli.warn_on_slow_precision("bf16-mixed", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cli.warn_on_slow_precision("32-true", "cpu")
    monkeypatch.setattr(console, "cpu_has_native_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cli.warn_on_slow_precision("bf16-mixed", "cpu")


def test_console_command_is_installed():
    exe = Path(sys.executable).with_name("shortcutlab")
    assert exe.exists(), "pip install -e . should install the shortcutlab command"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "fit" in out.stdout


def test_console_command_exits_zero_after_a_run(tmp_path):
    exe = Path(sys.executable).with_name("shortcutlab")
    out = subprocess.run([str(exe), "fit", *TINY_MAE, *DIGITS, "--trainer.fast_dev_run=1",
                          "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_help_documents_the_ckpt_path_the_package_accepts(subcommand):
    """``--ckpt_path``'s help names ``auto`` (fit) and the aliases refused, not Lightning's text
    offering them."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        cli.main([subcommand, "--help"])
    assert stop.value.code in (0, None)
    text = " ".join(out.getvalue().split())
    section = text[text.index("--ckpt_path CKPT_PATH ", text.index("--ckpt_path CKPT_PATH") + 1):][:600]
    assert "Could also be one of three special keywords" not in text
    assert ("'auto'" in section) == (subcommand == "fit")
    assert "'last', 'best', 'hpc', 'registry' and URLs are refused" in section


def test_the_command_ends_a_ddp_run_s_process_group_before_exit(tmp_path):
    """A finished DDP run destroys its process group itself (gloo's threads, left to the
    interpreter's teardown, aborted finished runs now and then); with none it does nothing."""
    import torch.distributed as dist

    cli.end_process_group()  # none initialised: nothing to do
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.is_initialized()
    cli.end_process_group()
    assert not dist.is_initialized()


@pytest.mark.parametrize("own", ["callbacks.py", "commands.py", "datamodules", "lightning_mods.py"])
def test_a_user_s_file_that_hides_a_package_is_one_line_naming_it(tmp_path, own):
    """docs/extending.md: a researcher's folder on PYTHONPATH with a file named as one of the
    package's packages; every command says which file hides which package and how to fix it."""
    folder = tmp_path / "mine"
    folder.mkdir()
    path = folder / own
    if own.endswith(".py"):
        path.write_text("X = 1\n")
    else:
        (path / "__init__.py").parent.mkdir()
        (path / "__init__.py").write_text("")
    exe = Path(sys.executable).with_name("shortcutlab")
    out = subprocess.run([str(exe), "fit", "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(folder)})
    package = own.removesuffix(".py")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"shortcutlab: error: {path} hides shortcutlab's "
                                                                 f"own '{package}' package"), out.stderr
    assert f"rename it (say my_{own})" in out.stderr


@pytest.mark.parametrize("config,owner", [("linear_probe_digits.yaml", "LinearProbe"),
                                          ("finetune_digits.yaml", "FineTuneClassifier")])
def test_an_evaluation_of_a_folder_names_the_file_it_read_and_ends_with_a_summary(mae_checkpoint, tmp_path, capsys,
                                                                                 config, owner):
    """Given a pre-training's folder, the probe and fine-tuning say which checkpoint they read,
    hparams.yaml records that file (not the folder), and the run ends with its final accuracies."""
    import yaml

    folder = mae_checkpoint.parents[3]  # <root>/lightning_logs/version_0/checkpoints/<file>
    capsys.readouterr()
    cli.main(["fit", f"--config={ROOT / 'configs' / config}", f"--model.checkpoint={folder}",
              "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
              "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
              f"--trainer.default_root_dir={tmp_path}"])
    out = capsys.readouterr().out
    read = [line for line in out.splitlines() if line.startswith(f"{owner}: reading the checkpoint ")]
    assert [p.name for p in mae_checkpoint.parent.iterdir()] == [mae_checkpoint.name]  # the one it can read
    assert len(read) == 1 and read[0].endswith(str(mae_checkpoint)), out[-2000:]
    (log,) = sorted(tmp_path.rglob("hparams.yaml"))
    assert yaml.safe_load(log.read_text())["checkpoint"] == str(mae_checkpoint)
    summary = json.loads((log.parent / "summary.json").read_text())
    assert 0.0 <= summary["metrics"]["val/top1"] <= 1.0 and summary["last_checkpoint"].endswith("last.ckpt")
    assert "shortcutlab evaluation summary" in out


def test_ckpt_path_takes_a_run_folder_as_model_checkpoint_does(mae_checkpoint, tmp_path, capsys):
    folder = mae_checkpoint.parents[3]
    capsys.readouterr()
    cli.main(["validate", *TINY_MAE, *DIGITS, f"--ckpt_path={folder}", "--trainer.limit_val_batches=1",
              "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
              f"--trainer.default_root_dir={tmp_path}"])
    assert f"shortcutlab: --ckpt_path {folder}: {mae_checkpoint}\n" in capsys.readouterr().err


def test_a_resumed_fit_logs_on_in_its_checkpoint_s_version_without_contradicting_warnings(tmp_path, recwarn):
    """One run, one curve: the resumed fit logs into version_0 (not version_1), metrics.csv keeps
    the rows logged before the checkpoint; Lightning's warnings that the dataloader is not
    resumable and that the checkpoint folder moved do not contradict an exact resume."""

    run_fit(tmp_path, "--trainer.limit_train_batches=4", "--trainer.callbacks+=ModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_top_k=-1")
    first = next(tmp_path.rglob("*step=2.ckpt"))  # written mid-epoch: half the epoch's batches to go
    args = ["fit", *TINY_MAE, *DIGITS, "--trainer.max_epochs=2", "--trainer.limit_train_batches=4",
            "--trainer.limit_val_batches=1", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
            f"--trainer.logger.init_args.save_dir={tmp_path}", f"--ckpt_path={first}"]
    cli.main(args)
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0"]
    rows = list(csv.DictReader(io.StringIO((tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text())))
    assert {row["epoch"] for row in rows} == {"0", "1"}
    assert not (tmp_path / "lightning_logs" / "version_0" / "metrics.before_resume.csv").exists()
    said = [str(w.message) for w in recwarn]
    assert not [m for m in said if "dataloader is not resumable" in m or "The dirpath has changed" in m], said


def test_sample_refuses_a_checkpoint_that_is_not_a_diffusion_model_s_in_one_line(mae_checkpoint, tmp_path, capsys):
    from commands import sample

    with pytest.raises(SystemExit) as stop:
        sample.main([str(mae_checkpoint), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"shortcutlab sample: error: checkpoint: {mae_checkpoint} is a MaskedAutoencoder checkpoint")
    assert not (tmp_path / "out").exists()


class Bar(TQDMProgressBar):
    """A progress bar of one's own whose name does not say so."""


class NotAProgressBarButEndsLikeOneProgressBar(Callback):
    """A callback whose name ends like a bar's."""


def test_a_progress_bar_is_known_by_its_class_not_its_name():
    """enable_progress_bar=false drops the configured bars: by class, so a bar named otherwise goes
    and a callback that only ends in 'ProgressBar' stays."""
    assert cli.is_progress_bar({"class_path": "callbacks.reporting.progress_bar.TrainingLossProgressBar"})
    assert cli.is_progress_bar({"class_path": f"{__name__}.Bar"}) and cli.is_progress_bar(Bar())
    assert not cli.is_progress_bar({"class_path": f"{__name__}.NotAProgressBarButEndsLikeOneProgressBar"})
    assert not cli.is_progress_bar({"class_path": "no.such.Module"})
