"""Progress bars of the long commands (feature_reuse, probe_diffusion, encode_latents), drawn
with ``rich.progress`` on stderr, so stdout keeps only the commands' results.

Shown only on a terminal: with ``--quiet``, or when stderr is a file or a pipe (a cluster job's
log), the bars are disabled and print nothing, so logs get no stream of redraws.
"""
from __future__ import annotations

import sys
from typing import Iterable, Iterator, Optional, TypeVar

from lightning.pytorch import Callback, LightningModule, Trainer
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

T = TypeVar("T")


def show_progress(quiet: bool = False) -> bool:
    """Bars on unless ``quiet`` or stderr is not a terminal."""
    return not quiet and sys.stderr.isatty()


def command_progress(enabled: bool) -> Progress:
    """A ``rich`` Progress (description, bar, done/total, elapsed, remaining); use it as a context
    manager. Disabled, it draws nothing and its ``track`` still yields every item."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), disable=not enabled)


def tracked(progress: Optional[Progress], items: Iterable[T], description: str,
            total: Optional[float] = None) -> Iterator[T]:
    """``items``, advancing a task of ``progress`` per item (no progress: ``items`` as they are)."""
    if progress is None:
        yield from items
        return
    task = progress.add_task(description, total=total if total is not None else _length(items))
    for item in items:
        yield item
        progress.advance(task)
    progress.remove_task(task)  # a finished inner loop leaves no line behind


def _length(items: Iterable) -> Optional[int]:
    try:
        return len(items)  # type: ignore[arg-type]
    except TypeError:
        return None


class EpochProgress(Callback):
    """One bar over the epochs of a fit (Lightning's own bars restart every epoch: a thousand
    short bars for the spiral), with the last ``train/loss`` in its description."""

    def __init__(self, progress: Progress, description: str) -> None:
        self.progress = progress
        self.description = description
        self.task = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.task = self.progress.add_task(self.description, total=trainer.max_epochs)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loss = trainer.callback_metrics.get("train/loss")
        suffix = f" (train/loss {float(loss):.4f})" if loss is not None else ""
        self.progress.update(self.task, advance=1, description=self.description + suffix)
