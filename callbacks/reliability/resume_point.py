"""The run's resume point: one checkpoint, ``latest.ckpt``, rewritten at the end of every training
epoch, whatever the cadence of the run's other checkpoints (``--checkpoint_every_n_epochs`` sets
theirs and leaves this one). ``--ckpt_path auto`` and a sweep's rerun resume from it."""
from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks.cost import PER_CHECKPOINT


class EpochResumePoint(ModelCheckpoint):
    """``ModelCheckpoint`` keeping ``latest.ckpt``, rewritten at every training epoch's end; every
    other argument is ModelCheckpoint's (``save_last: link`` makes ``last.ckpt`` a link to it)."""
    cost = PER_CHECKPOINT

    def __init__(self, filename: str = "latest", every_n_epochs: int = 1, save_top_k: int = 1,
                 save_on_train_epoch_end: bool = True, **kwargs: Any) -> None:
        super().__init__(filename=filename, every_n_epochs=every_n_epochs, save_top_k=save_top_k,
                         save_on_train_epoch_end=save_on_train_epoch_end, **kwargs)

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's key: the state of a run whose config wrote this checkpoint as a plain
        # ModelCheckpoint (filename latest, every epoch) resumes into it
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)
