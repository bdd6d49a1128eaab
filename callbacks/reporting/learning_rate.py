"""Every optimiser's learning rate in the logs, in every run: Lightning's ``LearningRateMonitor``
at the logging cadence, silent in a run without a logger (where Lightning's refuses to start)."""
from __future__ import annotations

from typing import Any, Literal, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor

from callbacks.cost import PER_STEP


class LearningRates(LearningRateMonitor):
    """LearningRateMonitor (same arguments; ``logging_interval`` step by default) that logs
    nothing, and raises nothing, in a run without a logger."""
    cost = PER_STEP

    def __init__(self, logging_interval: Optional[Literal["step", "epoch"]] = "step", log_momentum: bool = False,
                 log_weight_decay: bool = False) -> None:
        super().__init__(logging_interval=logging_interval, log_momentum=log_momentum,
                         log_weight_decay=log_weight_decay)
        self._logging = False

    def on_train_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        self._logging = bool(trainer.loggers)
        if self._logging:
            super().on_train_start(trainer, *args, **kwargs)

    def on_train_batch_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        if self._logging:
            super().on_train_batch_start(trainer, *args, **kwargs)

    def on_train_epoch_start(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        if self._logging:
            super().on_train_epoch_start(trainer, *args, **kwargs)
