"""A ``ModelCheckpoint`` that ranks and names a checkpoint only by a value logged for it.

Lightning keeps the last logged value of every metric in ``trainer.callback_metrics`` for the
whole fit. An evaluation callback that skips a validation (its ``every_n_epochs``, e.g. the FID
of ``callbacks.measurement.fid`` under ``--evaluation_every_n_epochs``) leaves the previous validation's
value there, and a plain ``ModelCheckpoint(monitor=...)`` would rank the new weights by it and
write its value into their file name (``step100000-fid10k11.65.ckpt`` holding weights whose FID
nobody measured). This one saves nothing at such a validation: the every-epoch ``latest``
checkpoint stays the resume point.

It is for a monitor logged in validation (FID, kNN, a probe's accuracy), saved at validation
end or at the end of a validated epoch; a monitor logged in training is never fresh there, and
step-based saves (``every_n_train_steps``) are ModelCheckpoint's own.
"""
from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from callbacks.cost import PER_CHECKPOINT


class FreshMonitorCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` (same arguments) whose validation-end save is skipped when
    ``monitor`` was not logged anew in that validation."""
    cost = PER_CHECKPOINT

    _before: Any = None
    _fresh = False  # whether the last validation logged ``monitor`` anew
    _measured = False  # whether any validation of this fit did

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fresh = False  # an epoch without validation measured nothing for its weights
        super().on_train_epoch_start(trainer, pl_module)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._before = trainer.callback_metrics.get(self.monitor) if self.monitor else None

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.monitor and not trainer.sanity_checking:
            # a value logged in this validation is a new tensor; one left from before is the
            # same object (the decision is the same on every rank: evaluation cadences are)
            now = trainer.callback_metrics.get(self.monitor)
            self._fresh = now is not None and now is not self._before
            self._measured = self._measured or self._fresh
            if not self._fresh:
                rank_zero_info(f"FreshMonitorCheckpoint: {self.monitor} was not measured at step "
                               f"{trainer.global_step}; no checkpoint ranked by an earlier value")
                return
        super().on_validation_end(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning saves here instead when validation runs once at the end of every epoch
        if self.monitor and not self._fresh:
            return
        super().on_train_epoch_end(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.monitor and not self._measured and trainer.current_epoch > 0:
            rank_zero_warn(f"FreshMonitorCheckpoint: no validation of this fit logged {self.monitor!r}, so no "
                           "checkpoint was ranked by it (is the name right? the evaluation cadence too sparse?)")
        super().on_train_end(trainer, pl_module)
