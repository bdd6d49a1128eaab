"""The progress bar of every shipped config: the training loss without a host read per step
(no per-step host syncs).

Lightning turns every value logged with ``prog_bar=True`` into a Python number after every
training batch, with or without a progress bar (its logger connector's ``on_batch_end``): on a
GPU, a host sync per step. The families therefore log their training loss without
``prog_bar``, and this bar shows it, read from ``trainer.callback_metrics`` (one host read)
every ``log_every_n_steps`` steps, the cadence at which the loggers write it too. A run named
rather than numbered (a sweep's ``alpha_min=1.0,seed=2``) shows its whole name as ``run``, where
Lightning's ``v_num`` keeps the last four characters (``=1.0``). Everything else is Lightning's
``RichProgressBar``.
"""
from __future__ import annotations

from typing import Optional, Union

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar

from lightning_mods.evaluation.metric_names import TRAIN_LOSS
from callbacks.cost import PER_STEP


class TrainingLossProgressBar(RichProgressBar):
    """``RichProgressBar`` (same arguments) that also shows ``train/loss``, the last step's value
    read every ``log_every_n_steps`` optimiser steps."""
    cost = PER_STEP

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._loss: Optional[float] = None
        self._read_at: Optional[int] = None  # the global step of the last read

    def get_metrics(self, trainer: Trainer,
                    pl_module: LightningModule) -> dict[str, Union[int, str, float, dict[str, float]]]:
        items = super().get_metrics(trainer, pl_module)
        if isinstance(items.get("v_num"), str) and trainer.loggers:  # a named version, cut to 4 characters
            del items["v_num"]
            items["run"] = str(trainer.loggers[0].version)
        if not trainer.training or trainer.sanity_checking:
            return items
        step = int(trainer.global_step)
        if self._read_at is None or not 0 <= step - self._read_at < max(1, trainer.log_every_n_steps):
            value = trainer.callback_metrics.get(TRAIN_LOSS)
            if value is not None:
                self._loss, self._read_at = float(value), step
        if self._loss is not None:
            items[TRAIN_LOSS] = self._loss
        return items
