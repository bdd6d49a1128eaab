"""When the evaluation callbacks run (kNN, effective rank): the same decision on every rank,
from state the trainer restores on resume (the epoch counter), never during the sanity check."""
from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn


def check_every_n_epochs(owner: str, every_n_epochs: int) -> int:
    """``every_n_epochs`` as an int >= 1, or a one-line ValueError naming ``owner``."""
    if isinstance(every_n_epochs, bool) or not isinstance(every_n_epochs, int) or every_n_epochs < 1:
        raise ValueError(f"{owner}: every_n_epochs must be an integer >= 1, got {every_n_epochs!r}")
    return every_n_epochs


def evaluation_due(trainer: Trainer, every_n_epochs: int) -> bool:
    """Whether an evaluation callback runs at the end of this validation epoch.

    Never during the sanity check. In ``validate`` always. In ``fit``: after epochs
    ``n - 1, 2n - 1, ...`` (0-indexed) and after the last epoch of ``max_epochs``, so a run
    always ends with a value.
    """
    if trainer.sanity_checking:
        return False
    if trainer.state.fn != TrainerFn.FITTING:
        return True
    epoch = trainer.current_epoch
    last = trainer.max_epochs is not None and trainer.max_epochs > 0 and epoch + 1 >= trainer.max_epochs
    return (epoch + 1) % every_n_epochs == 0 or last
