"""A CLI a newcomer can find their way in (part 3): the overview of ``shortcutlab``,
short class names, ``--model.help``, and ``--optimizer`` that replaces a module's own recipe only
when asked to."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback, LightningDataModule, LightningModule

import cli
from datamodules.digits import Digits
from commands import _catalogue as catalogue
from commands import lightning_cli

ROOT = Path(__file__).resolve().parents[2]
# short names only: what the overview and the README teach
TINY_MAE = ["--model", "MaskedAutoencoder", "--model.network", "MaskedAutoencoderViT", "--model.network.patch_size=8", "--model.network.embed_dim=16", "--model.network.depth=2",
            "--model.network.num_heads=2", "--model.network.decoder_embed_dim=8", "--model.network.decoder_depth=1",
            "--model.network.decoder_num_heads=2", "--model.num_reconstructions=0",
            "--data", "Digits", "--data.batch_size=16", "--data.image_size=16"]
FAST = ["--trainer.fast_dev_run=1", "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false"]


def live_classes(base: type, package: str) -> set[str]:
    """``module.Name`` of the subclasses of ``base`` defined in ``package`` (its modules imported)
    that no other class of the package subclasses: Python's own class hierarchy, the reference
    for the catalogue's reading of the source."""
    for path in (ROOT / package).rglob("*.py"):
        if path.name != "__init__.py":
            importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
    todo, seen = [base], set()
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    ours = {c for c in seen if c.__module__.startswith(f"{package}.")}
    return {f"{c.__module__}.{c.__qualname__}" for c in ours if not any(o is not c and c in o.__mro__ for o in ours)}


@pytest.mark.parametrize("kind, base", [("model", LightningModule), ("data", LightningDataModule),
                                        ("callback", Callback)])
def test_the_catalogue_read_from_the_source_is_the_imported_class_hierarchy(kind, base):
    package = catalogue.KINDS[kind][0]
    found = {f.class_path for f in catalogue.find(kind)}
    assert found == live_classes(base, package)
    assert all(f.summary for f in catalogue.find(kind)), "every class needs a docstring for the overview"


def test_the_three_families_and_the_datamodules_are_found():
    assert {"MaskedAutoencoder", "ImageClassifier", "DiffusionModule", "LinearProbe", "FineTuneClassifier", "SpiralClassifier"} <= \
        {f.name for f in catalogue.find("model")}
    assert {"Digits", "CIFAR10", "CIFAR100", "MNIST", "ImageNet", "Latents", "Spiral"} <= \
        {f.name for f in catalogue.find("data")}
    assert "ImageDataModule" not in {f.name for f in catalogue.find("data")}  # a base, not a dataset
    assert "ResidualDroppath" in {f.name for f in catalogue.find("callback")}


@pytest.mark.parametrize("argv", [[], ["-h"], ["--help"]])
def test_overview_names_models_data_configs_and_every_command(argv, capsys):
    cli.console_main(argv)
    text = capsys.readouterr().out
    unwrapped = " ".join(text.split())
    for kind in catalogue.KINDS:
        for found in catalogue.find(kind):
            shown = f"[{found.cost}] {found.summary}" if kind == "callback" else found.summary
            assert f"\n  {found.name}  " in text and f"{found.name} {shown}" in unwrapped
    for name in ("fit", "validate", "test", "predict", *cli.COMMANDS):
        assert f"\n  {name} " in text
    for _, description in cli.COMMANDS.values():
        assert " ".join(description.split()[:4]) in text
    quickstart = cli.QUICKSTART.split("--config ")[1]
    assert (ROOT / quickstart).is_file() and cli.QUICKSTART in text
    assert f"configs/ ({len(list((ROOT / 'configs').rglob('*.yaml')))} YAML files" in text
    assert "--model MaskedAutoencoder --model.network MaskedAutoencoderViT --data Digits" in text
    assert "--model.network.shortcut.alpha_min 0.8" in text
    assert max(len(line) for line in text.splitlines()) <= cli.WIDTH


def test_console_overview_imports_neither_torch_nor_lightning():
    """What the installed ``shortcutlab --help`` runs, in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    check = "import sys, cli; cli.console_main(); sys.exit(sorted({'torch', 'lightning'} & set(sys.modules)) or 0)"
    out = subprocess.run([sys.executable, "-c", check, "--help"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert "MaskedAutoencoder" in out.stdout and "Digits" in out.stdout


def resolve(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def run_cli(args: list[str], capsys, monkeypatch) -> str:
    """``shortcutlab <args>`` in-process for a command that prints and exits 0; its stdout."""
    monkeypatch.setattr(sys, "argv", ["shortcutlab"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        lightning_cli.main(args, parser_kwargs=lightning_cli.raising_parsers())
    assert exit_.value.code in (0, None)
    return capsys.readouterr().out


def test_fit_help_lists_the_model_and_data_classes(capsys, monkeypatch):
    text = " ".join(run_cli(["fit", "--help"], capsys, monkeypatch).split())  # undo the help's line wrapping
    for kind, base in (("model", "LightningModule"), ("data", "LightningDataModule")):
        listed = text.split(f"for any subclass of {base}.")[1].split("known subclasses:")[1].split(")")[0]
        classes = {resolve(path.strip()) for path in listed.split(",")}
        assert {resolve(found.class_path) for found in catalogue.find(kind)} <= classes
    assert "--replace_module_optimizer" in text


def test_short_class_names_and_short_keys(capsys, monkeypatch):
    dumped = run_cli(["fit", *TINY_MAE, "--model.network.shortcut.alpha_min=0.8", "--trainer.callbacks+=ResidualDroppath",
                      "--print_config"], capsys, monkeypatch)
    config = yaml.safe_load(dumped)
    assert config["model"]["class_path"] == "lightning_mods.mae.MaskedAutoencoder"
    network = config["model"]["init_args"]["network"]
    assert resolve(network["class_path"]) is resolve("lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT")
    assert network["init_args"]["shortcut"]["init_args"]["alpha_min"] == 0.8
    assert network["init_args"]["embed_dim"] == 16
    assert resolve(config["data"]["class_path"]) is Digits
    assert config["trainer"]["callbacks"][-1]["class_path"] == "callbacks.training.residual_droppath.ResidualDroppath"


@pytest.mark.parametrize("option, name, path, keys", [
    ("--model.help", "MaskedAutoencoder", "lightning_mods.mae.MaskedAutoencoder",
     ["--model.network", "--model.base_lr", "--model.num_reconstructions"]),
    ("--data.help", "Digits", "datamodules.digits.Digits", ["--data.image_size", "--data.batch_size"]),
    ("--model.help", "DiffusionModule", "lightning_mods.diffusion.DiffusionModule", ["--model.warmup_steps"]),
])
def test_help_of_a_class_by_its_short_name(option, name, path, keys, capsys, monkeypatch):
    text = run_cli(["fit", option, name], capsys, monkeypatch)
    shown = text.split(f"Help for {option}=")[1].split()[0]
    assert resolve(shown) is resolve(path)
    for key in keys:
        assert key in text


def test_help_of_the_network_a_recipe_is_given(capsys, monkeypatch):
    text = run_cli(["fit", "--model", "MaskedAutoencoder", "--model.network.help", "MaskedAutoencoderViT"], capsys,
                   monkeypatch)
    assert "--network.shortcut" in text and "--network.mask_ratio" in text and "--network.decoder_depth" in text


def console(argv: list[str], monkeypatch, capsys) -> tuple[int, list[str]]:
    """``shortcutlab <argv>`` as the console script runs it, in-process: exit status, stderr lines."""
    monkeypatch.setattr(sys, "argv", ["shortcutlab", *argv])
    monkeypatch.setattr(lightning_cli, "info_logs_to_stdout", lambda: None)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli.console_main()
    return exit_.value.code, capsys.readouterr().err.strip().splitlines()


def test_optimizer_without_the_opt_in_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    code, lines = console(["fit", *TINY_MAE, *FAST, "--optimizer", "AdamW", f"--trainer.default_root_dir={tmp_path}"],
                          monkeypatch, capsys)
    assert code == 2 and lines == [
        "shortcutlab: error: optimizer: AdamW would replace MaskedAutoencoder's own optimiser recipe "
        "(configure_optimizers: parameter groups, learning-rate scaling, schedule); set that recipe through the "
        "model's settings (--model.help MaskedAutoencoder), or add --replace_module_optimizer=true to train every "
        "parameter with AdamW instead"]
    assert not any(tmp_path.iterdir())  # refused before anything was built or written


def test_lr_scheduler_without_optimizer_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """LightningCLI alone would ignore it without a word."""
    code, lines = console(["fit", *TINY_MAE, *FAST, "--lr_scheduler", "StepLR", "--lr_scheduler.step_size=2",
                           f"--trainer.default_root_dir={tmp_path}"], monkeypatch, capsys)
    assert code == 2 and lines == [
        "shortcutlab: error: lr_scheduler: StepLR is used only together with --optimizer; a model's own schedule "
        "is set by its settings (--model.help MaskedAutoencoder)"]


@pytest.mark.slow
def test_opted_in_optimizer_and_scheduler_replace_the_recipe(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = lightning_cli.main(["fit", *TINY_MAE, *FAST, "--replace_module_optimizer=true",
                                  "--optimizer", "SGD", "--optimizer.lr=0.05", "--optimizer.momentum=0.5",
                                  "--lr_scheduler", "StepLR", "--lr_scheduler.step_size=3",
                                  f"--trainer.default_root_dir={tmp_path}"])
    messages = [str(w.message) for w in caught if "configure_optimizers" in str(w.message)]
    assert messages == [
        "--replace_module_optimizer: MaskedAutoencoder.configure_optimizers is not used; every parameter trains "
        "with SGD(lr=0.05, momentum=0.5) and StepLR(step_size=3), in one group: the module's own parameter groups "
        "(no weight decay on norms and biases), learning-rate scaling by batch size, warm-up and schedule, and the "
        "model settings they read, do not apply"]  # Lightning's own "will be overridden" line is not repeated
    (optimizer,) = out.trainer.optimizers
    assert type(optimizer) is torch.optim.SGD
    (group,) = optimizer.param_groups  # one group: the module's decay / no-decay split is gone
    assert group["initial_lr"] == 0.05 and group["momentum"] == 0.5 and group["weight_decay"] == 0
    assert {id(p) for p in group["params"]} == {id(p) for p in out.model.parameters()}
    (scheduler,) = out.trainer.lr_scheduler_configs
    assert type(scheduler.scheduler) is torch.optim.lr_scheduler.StepLR and scheduler.scheduler.step_size == 3


@pytest.mark.parametrize("args, start, kinds", [
    (["--model", "MaskedAutoEncoder", "--data", "Digits"],
     "model: no class 'MaskedAutoEncoder'; did you mean 'MaskedAutoencoder'? known: ", ["model"]),
    (["--model", "MaskedAutoencoder", "--data", "Digit"], "data: no class 'Digit'; did you mean 'Digits'? known: ",
     ["data"]),
    (["--model.help", "Nope"], "no class 'Nope'; known: ", ["model", "data"]),
])
def test_an_unknown_class_name_is_one_line_naming_the_known_ones(args, start, kinds, tmp_path, monkeypatch, capsys):
    code, lines = console(["fit", *args, f"--trainer.default_root_dir={tmp_path}"], monkeypatch, capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"shortcutlab: error: {start}")
    known = lines[0].split("known: ")[1].removesuffix(" (or a full import path)").split(", ")
    assert known == [name for kind in kinds for name in
                     ("DiffusionModule FineTuneClassifier ImageClassifier LinearProbe MaskedAutoencoder SpiralClassifier" if kind == "model"
                      else "CIFAR10 CIFAR100 Digits ImageNet Latents MNIST Spiral").split()]


def test_console_main_with_argv_runs_those_arguments_and_leaves_sys_argv_alone(tmp_path, monkeypatch, capsys):
    """``cli.console_main(argv)`` from Python: the training command parses ``argv``, not the
    process's own command line, and ``sys.argv`` is the same afterwards."""
    monkeypatch.setattr(sys, "argv", ["host-program"])
    monkeypatch.setattr(lightning_cli, "info_logs_to_stdout", lambda: None)
    with pytest.raises(SystemExit) as exit_:
        cli.console_main(["fit", "--model", "MaskedAutoEncoder", "--data", "Digits",
                          f"--trainer.default_root_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "no class 'MaskedAutoEncoder'" in err
    assert sys.argv == ["host-program"]


def test_a_renamed_command_still_runs_with_a_one_line_notice(capsys):
    import cli

    with pytest.raises(SystemExit) as stop:
        cli.console_main(["shards", "--help"])
    out, err = capsys.readouterr()
    assert stop.value.code == 0 and out.startswith("usage: shortcutlab chunks")
    assert err == "shortcutlab: 'shards' is 'chunks' since release 0.3\n"
    assert "shards" not in cli.overview() and "chunks" in cli.overview()


def test_a_renamed_option_is_taken_under_its_new_name_with_a_one_line_notice(capsys):
    from commands._renamed_options import renamed_options

    args = ["--out", "x", "--shard-size=512", "--shard-sizes", "3", "--shard-size", "64"]
    assert renamed_options(args, {"--shard-size": "--part-size"}, "encode_latents") == [
        "--out", "x", "--part-size=512", "--shard-sizes", "3", "--part-size", "64"]
    assert capsys.readouterr().err == "encode_latents: --shard-size is --part-size since release 0.3\n" * 2
    assert renamed_options(["--out", "x"], {"--shard-size": "--part-size"}, "encode_latents") == ["--out", "x"]
    assert capsys.readouterr().err == ""
