"""When the evaluation callbacks run (kNN, effective rank, FID): the same decision on every rank,
from state the trainer restores on resume (the epoch counter), never during the sanity check.

``every_n_epochs=None`` follows the trainer's validation cadence (``check_val_every_n_epoch``);
an int evaluates at the validation epochs ``n - 1, 2n - 1, ...`` (0-indexed). Either way the
last epoch of ``fit`` evaluates, so a short run (``--trainer.max_epochs 2``) still reports values.
"""
from __future__ import annotations

from typing import Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn


def check_every_n_epochs(owner: str, every_n_epochs: Optional[int]) -> Optional[int]:
    """``every_n_epochs`` as None or an int >= 1, or a one-line ValueError naming ``owner``."""
    if every_n_epochs is None:
        return None
    if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
        raise ValueError(f"{owner}: every_n_epochs must be an integer >= 1 or null (follow "
                         f"trainer.check_val_every_n_epoch), got {every_n_epochs!r}")
    return every_n_epochs


def check_step_cadence(owner: str, every_n_steps: Optional[int]) -> Optional[int]:
    """``check_every_n_steps`` as None or an int >= 1, or a one-line ValueError naming ``owner``."""
    if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                      or every_n_steps < 1):
        raise ValueError(f"{owner}: check_every_n_steps must be an integer >= 1 or None, got {every_n_steps!r}")
    return every_n_steps


def every_n_steps_or_logging(trainer: Trainer, every_n_steps: Optional[int]) -> int:
    """``every_n_steps``, else the trainer's ``log_every_n_steps`` (at least 1)."""
    return every_n_steps or max(1, int(trainer.log_every_n_steps or 1))


def is_last_epoch(trainer: Trainer) -> bool:
    """Whether this is the last epoch of ``max_epochs`` (False for step- or time-limited runs)."""
    return trainer.max_epochs is not None and trainer.max_epochs > 0 and trainer.current_epoch + 1 >= trainer.max_epochs


def reaches_max_steps(trainer: Trainer) -> bool:
    """Whether ``fit`` has taken its ``max_steps`` optimiser steps (False without a step limit)."""
    max_steps = trainer.max_steps
    return max_steps is not None and max_steps > 0 and trainer.global_step >= max_steps


def evaluation_due(trainer: Trainer, every_n_epochs: Optional[int]) -> bool:
    """Whether an evaluation callback runs at the end of this validation epoch.

    Never during the sanity check. In ``validate`` always. In ``fit``: at every validation
    (``every_n_epochs=None``) or after epochs ``n - 1, 2n - 1, ...`` (0-indexed), and at the end of
    ``fit``: after the last epoch of ``max_epochs``, or at the step ``max_steps`` stops it.
    """
    if trainer.sanity_checking:
        return False
    if trainer.state.fn != TrainerFn.FITTING:
        return True
    if every_n_epochs is None or is_last_epoch(trainer) or reaches_max_steps(trainer):
        return True
    return (trainer.current_epoch + 1) % every_n_epochs == 0


class ScheduledEvaluation(Callback):
    """Base of the evaluation callbacks: the end of ``fit`` is validated and evaluated whatever the
    cadence. At the last epoch of ``max_epochs`` the trainer validates even when
    ``check_val_every_n_epoch`` would skip it (Lightning validates only at its multiples); at the
    step ``max_steps`` stops a fit, mid-epoch too, the trainer is asked to stop there, which makes
    Lightning validate (as for early stopping). The trainer's own cadence is back after the epoch.

    Subclasses set ``self.every_n_epochs`` and ask :func:`evaluation_due` in their hooks.
    """

    _saved_check_val: Optional[int] = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if is_last_epoch(trainer):
            self._validate_this_epoch(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: object,
                           batch_idx: int) -> None:
        # a Python comparison a step: the same decision on every rank, no host read
        if reaches_max_steps(trainer) and not trainer.should_stop:
            trainer.should_stop = True
            self._validate_this_epoch(trainer)

    def _validate_this_epoch(self, trainer: Trainer) -> None:
        every = trainer.check_val_every_n_epoch
        if every is not None and (trainer.current_epoch + 1) % every != 0 and self._saved_check_val is None:
            self._saved_check_val, trainer.check_val_every_n_epoch = every, 1

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._saved_check_val is not None:
            trainer.check_val_every_n_epoch, self._saved_check_val = self._saved_check_val, None
