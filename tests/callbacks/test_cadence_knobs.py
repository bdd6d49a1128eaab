"""The top-level cadence knobs of the CLI: ``--evaluation_every_n_epochs`` reaches every
evaluation callback, ``--checkpoint_every_n_epochs`` every ModelCheckpoint but the every-epoch
``latest`` one (the resume point); without them the config's cadences stay."""
from __future__ import annotations

import warnings

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks.measurement.effective_rank import EffectiveRank
from callbacks.measurement.knn import KNNEvaluator
from commands.lightning_cli import ShortcutLabCLI
from helpers.composed_configs import command_args


def built_callbacks(args: list[str]) -> list:
    with warnings.catch_warnings():  # the paper configs' bf16-mixed, on this CPU (tests/commands/test_cli.py: the warning)
        warnings.filterwarnings("ignore", r"trainer\.precision='bf16-mixed' on a CPU", UserWarning)
        cli = ShortcutLabCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                             run=False, args=[*args, "--trainer.logger=false"])
    return cli.trainer.callbacks


def cadences(callbacks: list) -> dict[str, object]:
    out = {}
    for cb in callbacks:
        if isinstance(cb, (KNNEvaluator, EffectiveRank)):
            out[type(cb).__name__] = cb.every_n_epochs
        elif isinstance(cb, ModelCheckpoint):
            out[f"ModelCheckpoint({cb.filename or 'default'})"] = cb._every_n_epochs
    return out


def test_quickstart_evaluation_and_checkpoint_knobs():
    args = command_args("digits_mae.yaml")
    # the quickstart's evaluation callbacks follow check_val_every_n_epoch (25); its one
    # ModelCheckpoint is the every-epoch latest.ckpt resume point, which the checkpoint knob leaves
    assert cadences(built_callbacks(args)) == {"KNNEvaluator": None, "EffectiveRank": None,
                                               "ModelCheckpoint(latest)": 1}
    knobs = ["--evaluation_every_n_epochs=3", "--checkpoint_every_n_epochs=7"]
    assert cadences(built_callbacks([*args, *knobs])) == {"KNNEvaluator": 3, "EffectiveRank": 3,
                                                          "ModelCheckpoint(latest)": 1}


def test_checkpoint_knob_leaves_the_latest_checkpoint_every_epoch():
    args = command_args("cifar10_resnet18_alpha0.6")  # keep-every-50 checkpoints + latest.ckpt every epoch
    assert cadences(built_callbacks(args)) == {"EffectiveRank": 20, "ModelCheckpoint(default)": 50,
                                               "ModelCheckpoint(latest)": 1}
    assert cadences(built_callbacks([*args, "--checkpoint_every_n_epochs=10"])) == {
        "EffectiveRank": 20, "ModelCheckpoint(default)": 10, "ModelCheckpoint(latest)": 1}


def test_cadence_knobs_refuse_non_positive_values(capsys):
    import pytest

    for bad in ("0", "-2"):
        with pytest.raises(SystemExit):
            built_callbacks([*command_args("digits_mae.yaml"), f"--checkpoint_every_n_epochs={bad}"])
    assert "checkpoint_every_n_epochs" in capsys.readouterr().err
