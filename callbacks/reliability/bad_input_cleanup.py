"""A run refused for bad input leaves the disk as it found it (one-line errors).

Lightning creates the logger's version folder (and TensorBoard's event file) before the
datamodule's ``setup`` runs, so a missing data folder or an unreadable first image would
leave an empty ``version_N`` behind on every try. :class:`RemoveLogsOnBadInput` removes the
log folders this run created when the run stops on bad input (``ValueError``,
``FileNotFoundError``) or a file it cannot write (a full disk: ``DiskWriteError``) before its first optimiser step and nothing in them is a checkpoint.
A folder that existed before the run is never touched.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_mods.checkpointing.atomic_files import DiskWriteError
from callbacks.cost import ONCE


def new_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, innermost first."""
    missing = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


class RemoveLogsOnBadInput(Callback):
    """Removes the log folders a run created when it stops on bad input before its first step.

    Which folders are new is recorded by :meth:`watch`, called once the Trainer (its loggers) is
    built and before it runs: the ``shortcutlab`` CLI calls it on the instance of its default
    callback list. A Trainer built in Python calls it too, or the folders are never removed.
    """
    cost = ONCE

    def __init__(self) -> None:
        self.created: list[Path] = []

    def watch(self, trainer: Trainer) -> None:
        """Record the Trainer's log folders that do not exist yet (before anything creates them)."""
        self.created = [folder for logger in trainer.loggers if getattr(logger, "log_dir", None)
                        for folder in new_folders(Path(logger.log_dir))]

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, (ValueError, FileNotFoundError, DiskWriteError)) or trainer.global_step > 0 \
                or not trainer.is_global_zero:
            return
        for folder in self.created:
            if folder.is_dir() and not any(folder.rglob("*.ckpt")):
                shutil.rmtree(folder)
