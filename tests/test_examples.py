"""Each file of ``examples/`` run as a user would: copied into a folder outside the repository,
only that folder on ``PYTHONPATH``, through ``shortcutlab fit`` with a short budget: the
commands docs/extending.md shows."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_mods.backbone import shortcut_alphas
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.backbone.uvit import UViT

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
         "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu"]
TINY_MAE = ["--model.network.depth=2", "--model.network.decoder_depth=1", "--model.network.embed_dim=32",
            "--model.network.num_heads=2"]


WARM: list[str] = []  # the fork server's command line while this module's tests run


@pytest.fixture(scope="module", autouse=True)
def warm_cli():
    """``shortcutlab`` through a warm fork of the CLI (tests/helpers/fork_server.py): each command still
    runs in a process of its own, with only the user's folder on ``PYTHONPATH``."""
    from helpers.fork_server import ForkServer

    with ForkServer({k: v for k, v in os.environ.items() if k != "PYTHONPATH"}) as warm:
        WARM[:] = warm.command().split()
        yield
    WARM.clear()


def shortcutlab(cwd: Path, *args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    command = WARM or [sys.executable, "-m", "cli"]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def user_folder(tmp_path: Path, *examples: str) -> Path:
    folder = tmp_path / "my_experiment"
    folder.mkdir()
    for name in examples:
        shutil.copy(ROOT / "examples" / name, folder / name)
    return folder


def fit_digits_mae(folder: Path, run: str, *extra: str) -> Path:
    """A short ``configs/digits_mae.yaml`` fit from the user's folder; its ``last.ckpt``."""
    fit = shortcutlab(folder, "fit", f"--config={ROOT / 'configs/digits_mae.yaml'}", *TINY_MAE, *SHORT, *extra,
                      f"--trainer.default_root_dir={folder / run}", pythonpath=folder)
    assert fit.returncode == 0, fit.stderr[-3000:]
    (ckpt,) = (folder / run).rglob("last.ckpt")
    return ckpt


def expected_exponential_alphas(rate: float, alpha_min: float, num_sublayers: int) -> list[float]:
    """float64 numpy, independent of the example's code."""
    return np.maximum(alpha_min, np.exp(-rate * np.arange(num_sublayers, dtype=np.float64))).tolist()


@pytest.mark.slow
def test_exponential_schedule_through_mae_and_resnet_yaml_and_linear_probe(tmp_path, monkeypatch):
    folder = user_folder(tmp_path, "exponential_schedule.py")
    # the MAE, the schedule chosen on the command line (digits_mae.yaml's alpha_min 0.6 carried over)
    mae_ckpt = fit_digits_mae(folder, "mae", "--model.network.shortcut=exponential_schedule.ExponentialSchedule",
                              "--model.network.shortcut.rate=0.2")
    written = torch.load(mae_ckpt, weights_only=True)["hyper_parameters"]["network"]["init_args"]["shortcut"]
    assert written == {"class_path": "exponential_schedule.ExponentialSchedule",
                       "init_args": {"rate": 0.2, "alpha_min": 0.6, "branches": "both"}}
    # the ResNet classifier, the schedule chosen in a YAML file of the user's
    (folder / "exp_resnet.yaml").write_text(
        "model:\n  init_args:\n    network:\n      init_args:\n        shortcut:\n"
        "          class_path: exponential_schedule.ExponentialSchedule\n"
        "          init_args: {rate: 0.1, alpha_min: 0.0}\n")
    fit = shortcutlab(folder, "fit", f"--config={ROOT / 'configs/data/digits.yaml'}",
                      f"--config={ROOT / 'configs/digits_resnet/base.yaml'}", "--config=exp_resnet.yaml",
                      *SHORT, f"--trainer.default_root_dir={folder / 'resnet'}", pythonpath=folder)
    assert fit.returncode == 0, fit.stderr[-3000:]
    (resnet_ckpt,) = (folder / "resnet").rglob("latest*.ckpt")
    # LinearProbe rebuilds each network from its checkpoint: the user's schedule, its alphas, no warning
    monkeypatch.syspath_prepend(str(folder))
    from lightning_mods.linear_probe import LinearProbe

    for ckpt, rate, alpha_min in ((mae_ckpt, 0.2, 0.6), (resnet_ckpt, 0.1, 0.0)):
        probe = LinearProbe(checkpoint=str(ckpt), num_classes=10)
        assert type(probe.backbone.shortcut if hasattr(probe.backbone, "shortcut") else
                    probe.backbone.network.shortcut).__name__ == "ExponentialSchedule"
        alphas = shortcut_alphas(probe.backbone)
        np.testing.assert_allclose(alphas, expected_exponential_alphas(rate, alpha_min, len(alphas)), rtol=0, atol=1e-15)
        assert len(set(alphas)) > 2  # the schedule really decays here
        probe_run = shortcutlab(folder, "fit", f"--config={ROOT / 'configs/linear_probe_digits.yaml'}",
                                f"--model.checkpoint={ckpt}", *SHORT,
                                f"--trainer.default_root_dir={folder / ('probe_' + ckpt.parent.parent.parent.parent.name)}",
                                pythonpath=folder)
        assert probe_run.returncode == 0, probe_run.stderr[-3000:]
        assert "shortcut" not in probe_run.stderr.lower(), probe_run.stderr[-3000:]  # no "weights not its own"
    # without the schedule's module, the checkpoint is refused in one line, never rebuilt as another network
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    refused = shortcutlab(elsewhere, "fit", f"--config={ROOT / 'configs/linear_probe_digits.yaml'}",
                          f"--model.checkpoint={mae_ckpt}", *SHORT, f"--trainer.default_root_dir={elsewhere}")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "shortcutlab: error: checkpoint settings: cannot import 'exponential_schedule.ExponentialSchedule', a class "
        "the checkpoint was written with (No module named 'exponential_schedule'); put its module on PYTHONPATH")


def test_a_schedule_subclass_solves_alpha_min_and_compares_by_class(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(user_folder(tmp_path, "exponential_schedule.py")))
    from exponential_schedule import ExponentialSchedule

    from lightning_mods.backbone import ShortcutSchedule

    schedule = ExponentialSchedule(rate=0.5, alpha_min=0.2)
    assert ShortcutSchedule.coerce(schedule.as_dict()) == schedule
    assert schedule != ShortcutSchedule("linear", 0.2)
    # alpha_eff of the solved alpha_min hits the target (float64 numpy reference)
    solved = schedule.solve_alpha_min(0.05, 8)
    assert np.prod(expected_exponential_alphas(0.5, solved, 8)) == pytest.approx(0.05, rel=1e-12)
    with pytest.raises(ValueError, match="is not a ShortcutSchedule class"):
        ShortcutSchedule.coerce({"class_path": "torch.nn.Linear", "init_args": {}})


@pytest.mark.slow
def test_mae_l1_loss_on_gradients_trains_and_its_checkpoint_is_that_model(tmp_path, monkeypatch):
    folder = user_folder(tmp_path, "mae_l1_loss.py")
    ckpt = fit_digits_mae(folder, "run", "--model.network=mae_l1_loss.L1MaskedAutoencoderViT",
                          "--model.network.target=gradients")
    monkeypatch.syspath_prepend(str(folder))
    from lightning_mods.checkpointing.rebuild import module_from_checkpoint

    model, settings = module_from_checkpoint(ckpt, name="model")
    network = settings["init_args"]["network"]
    assert type(model.network).__name__ == "L1MaskedAutoencoderViT" and network["init_args"]["target"] == "gradients"
    model.eval()
    x = torch.rand(3, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss, pred, mask = model(x, generator=torch.Generator().manual_seed(1))
    # float64 numpy: horizontal differences, 8x8 patches (digits_mae.yaml), L1 over masked patches
    image = x.double().numpy()[:, 0]
    grad = np.zeros_like(image)
    grad[:, :, 1:] = image[:, :, 1:] - image[:, :, :-1]
    p = model.network.patch_size
    patches = grad.reshape(3, 16 // p, p, 16 // p, p).transpose(0, 1, 3, 2, 4).reshape(3, -1, p * p)
    per_patch = np.abs(pred.double().numpy() - patches).mean(-1)
    m = mask.double().numpy()
    assert loss.item() == pytest.approx((per_patch * m).sum() / m.sum(), rel=1e-6)


@pytest.mark.slow
def test_branch_norm_ratio_callback_logs_one_value_per_block(tmp_path, monkeypatch):
    folder = user_folder(tmp_path, "branch_norm_ratio.py")
    fit_digits_mae(folder, "run", "--trainer.check_val_every_n_epoch=1",
                   "--trainer.callbacks+=branch_norm_ratio.BranchNormRatio",
                   "--model.network.zero_init_branches=false",  # the paper's zero-started branches measure 0 at first
                   "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                   f"--trainer.logger.init_args.save_dir={folder / 'run'}")
    import csv

    (metrics,) = (folder / "run").rglob("metrics.csv")
    with metrics.open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("branch_ratio/block1")]
    assert len(rows) == 1 and float(rows[0]["branch_ratio/block1"]) > 0 and float(rows[0]["branch_ratio/block2"]) > 0
    assert "branch_ratio/block3" not in rows[0]  # the encoder's two blocks; the decoder does not run
    # the value, by hand from the blocks' own branch functions (no hook), on a tiny MAE
    monkeypatch.syspath_prepend(str(folder))
    from branch_norm_ratio import branch_to_output_ratios

    from lightning_mods.mae import MaskedAutoencoder

    torch.manual_seed(0)
    model = MaskedAutoencoder(MaskedAutoencoderViT(img_size=16, in_chans=1, patch_size=4, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, zero_init_branches=False), num_reconstructions=0).eval()
    x = torch.rand(5, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    ratios = branch_to_output_ratios(model, x)
    with torch.no_grad():
        h = torch.cat([model.network._cls(5), model.network._embed_patches(x)], dim=1)
        for block, ratio in zip(model.network.encoder.blocks, ratios):
            attn = block.attn_branch(h)
            h1 = block.shortcut_weight(0) * h + attn
            mlp = block.mlp_branch(h1)
            h = block.shortcut_weight(1) * h1 + mlp
            norms = [t.double().flatten(1).norm(dim=1).mean() for t in (attn, mlp)]
            expected = (norms[0] + norms[1]) / 2 / h.double().flatten(1).norm(dim=1).mean()
            assert ratio.item() == pytest.approx(expected.item(), rel=1e-5)
    assert len(ratios) == 2


@pytest.mark.slow
def test_deit_style_vit_classifier_from_yaml_alone(tmp_path):
    folder = tmp_path / "my_experiment"
    folder.mkdir()
    fit = shortcutlab(folder, "fit", f"--config={ROOT / 'configs/data/digits.yaml'}",
                      f"--config={ROOT / 'configs/digits_resnet/base.yaml'}",
                      f"--config={ROOT / 'examples/deit_tiny_classifier.yaml'}", *SHORT,
                      f"--trainer.default_root_dir={folder / 'run'}")
    assert fit.returncode == 0, fit.stderr[-3000:]
    (ckpt,) = (folder / "run").rglob("latest*.ckpt")
    from lightning_mods.linear_probe import LinearProbe

    probe = LinearProbe(checkpoint=str(ckpt), num_classes=10)
    backbone = probe.backbone.network
    assert type(backbone).__name__ == "DecayedVisionTransformer"
    assert (backbone.embed_dim, len(backbone.blocks), backbone.global_pool) == (192, 4, "token")
    alphas = shortcut_alphas(backbone)
    expected = [1 - k / 7 * 0.4 for k in range(8)]  # linear, alpha_min 0.6 over 2 x 4 sub-layers
    np.testing.assert_allclose(alphas, expected, rtol=0, atol=1e-12)


def test_the_schedule_of_ones_own_in_the_diffusion_and_spiral_families(tmp_path, monkeypatch):
    """The families built in Python here (the MAE and the ResNet classifier run through the CLI
    above): each saves the schedule's class and settings and a checkpoint's hyper-parameters
    rebuild it, with the float64 alphas."""
    monkeypatch.syspath_prepend(str(user_folder(tmp_path, "exponential_schedule.py")))
    from exponential_schedule import ExponentialSchedule

    from lightning_mods.backbone import ShortcutSchedule
    from lightning_mods.diffusion import DiffusionModule
    from lightning_mods.backbone.residual_mlp import ResidualMLP
    from lightning_mods.spiral_classifier import SpiralClassifier

    schedule = ExponentialSchedule(rate=0.3, alpha_min=0.1)
    diffusion = DiffusionModule(UViT(img_size=8, in_chans=1, patch_size=2, embed_dim=32, depth=2, num_heads=4,
                                     shortcut=schedule, zero_init_branches=True),
                                pixel_mean=[0.5], pixel_std=[0.5], num_sampling_steps=4)
    spiral = SpiralClassifier(ResidualMLP(depth=4, width=6, shortcut=schedule))
    for module, saved in ((diffusion, diffusion.hparams["network"]["init_args"]["shortcut"]),
                          (spiral, spiral.hparams["network"]["init_args"]["shortcut"])):
        assert saved == {"class_path": "exponential_schedule.ExponentialSchedule",
                         "init_args": {"rate": 0.3, "alpha_min": 0.1, "branches": "both"}}
        assert ShortcutSchedule.coerce(saved) == schedule
        alphas = shortcut_alphas(module)
        np.testing.assert_allclose(alphas, expected_exponential_alphas(0.3, 0.1, len(alphas)), rtol=0, atol=1e-15)


def documented_commands(path: Path) -> list[list[str]]:
    """The ``shortcutlab fit`` commands of an example's docstring (or a YAML example's comments),
    continuation lines joined, as argument lists."""
    import shlex

    text = path.read_text()
    lines = [line.strip().lstrip("#").strip() for line in text.splitlines()]
    commands, current = [], ""
    for line in lines:
        if current:
            current += " " + line
        elif line.startswith("shortcutlab fit"):
            current = line
        else:
            continue
        if current.endswith("\\"):  # a continuation (written "\\\\" inside a docstring)
            current = current.rstrip("\\").rstrip()
            continue
        commands.append(shlex.split(current)[1:])
        current = ""
    return commands


def test_every_command_in_an_example_parses_as_written(monkeypatch):
    """Each command an example names, from the repository (where its config paths resolve) with
    the examples' folder importable, is parsed as ``shortcutlab fit`` parses it (an unknown key, a
    missing data config or class: one line here); the tests above fit them."""
    from commands.lightning_cli import ArgumentChecker

    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    check = ArgumentChecker()
    for path in sorted(p for p in (ROOT / "examples").iterdir() if p.suffix in (".py", ".yaml")):
        commands = documented_commands(path)
        assert commands, f"{path.name} names no shortcutlab fit command"
        for command in commands:
            assert check(command) is None, f"{path.name}: {' '.join(command)}: {check(command)}"
