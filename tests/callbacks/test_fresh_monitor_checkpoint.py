"""FreshMonitorCheckpoint: a checkpoint is ranked and named only by a value measured for it."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from callbacks.reliability.fresh_monitor_checkpoint import FreshMonitorCheckpoint
from helpers.line_module import Line


class ScoreEverySecondEpoch(Callback):
    """An evaluation callback that measures every second validation: val/score = 10 * epoch at
    epochs 0 and 2."""

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking and trainer.current_epoch % 2 == 0:
            pl_module.log("val/score", float(10 * trainer.current_epoch))


def fit(tmp_path, checkpoint: ModelCheckpoint, every_2_steps: bool = False) -> list[str]:
    """4 epochs of 2 steps, validating after each (every 2 steps: ModelCheckpoint then saves at
    validation end, as in the diffusion configs, instead of at the train epoch's end)."""
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    cadence = dict(val_check_interval=2, check_val_every_n_epoch=None) if every_2_steps else {}
    trainer = L.Trainer(max_epochs=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, **cadence,
                        callbacks=[ScoreEverySecondEpoch(), checkpoint])
    trainer.fit(Line(), loader, loader)
    folder = tmp_path / "ckpts"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@pytest.mark.parametrize("every_2_steps", [False, True], ids=["epoch_end", "validation_end"])
def test_a_validation_that_did_not_measure_the_monitor_saves_nothing(tmp_path, every_2_steps):
    kwargs = dict(dirpath=tmp_path / "ckpts", monitor="val/score", mode="max", save_top_k=-1,
                  filename="epoch{epoch}-score{val/score:.0f}", auto_insert_metric_name=False)
    assert fit(tmp_path, FreshMonitorCheckpoint(**kwargs), every_2_steps) == ["epoch0-score0.ckpt", "epoch2-score20.ckpt"]
    # what the plain ModelCheckpoint does: epoch 1's weights named and ranked by epoch 0's score
    stale = tmp_path / "plain"
    assert fit(stale, ModelCheckpoint(**{**kwargs, "dirpath": stale / "ckpts"}), every_2_steps) == [
        "epoch0-score0.ckpt", "epoch1-score0.ckpt", "epoch2-score20.ckpt", "epoch3-score20.ckpt"]


def test_a_monitor_logged_at_every_validation_saves_every_time(tmp_path):
    checkpoint = FreshMonitorCheckpoint(dirpath=tmp_path / "ckpts", monitor="val/loss", save_top_k=-1,
                                        filename="epoch{epoch}", auto_insert_metric_name=False)
    assert fit(tmp_path, checkpoint) == [f"epoch{e}.ckpt" for e in range(4)]


def test_a_monitor_never_logged_warns_at_the_end(tmp_path):
    checkpoint = FreshMonitorCheckpoint(dirpath=tmp_path / "ckpts", monitor="val/scor", save_top_k=-1)
    with pytest.warns(UserWarning, match="no validation of this fit logged 'val/scor'"):
        fit(tmp_path, checkpoint)
