"""A bar and a duration for a pass over a whole dataset inside a run (the kNN bank, the
validation features, the effective rank's features): such a pass takes minutes at ImageNet
scale and would otherwise print nothing.

On rank 0, with the Trainer's progress bar on (``enable_progress_bar``), the pass gets a task in
the Trainer's own Rich bar while that bar is drawn, else a bar of its own on a terminal (the
commands' style: description, bar, done/total, elapsed, remaining); off with the progress bar,
as the training bar is. Whatever the bar, rank 0 logs one line with the pass's duration
(``KNNEvaluator: bank_dataset, 1437 images in 1.0 s``).
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, Optional

from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities import rank_zero_info
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def duration_text(seconds: float) -> str:
    """``0.4 s``, ``12.0 s``, ``3 min 4 s``, ``2 h 5 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    return f"{minutes // 60} h {minutes % 60} min"


def _drawn_rich_bar(trainer: object) -> Optional[Progress]:
    """The Trainer's Rich progress display while it is drawn, else None."""
    bar = getattr(trainer, "progress_bar_callback", None)
    progress = getattr(bar, "progress", None)
    if isinstance(bar, RichProgressBar) and progress is not None and progress.live.is_started:
        return progress
    return None


def bar_wanted(trainer: object) -> bool:
    """Rank 0 of a Trainer whose progress bar is on."""
    return bool(getattr(trainer, "is_global_zero", True)) and getattr(trainer, "progress_bar_callback", None) is not None


@contextlib.contextmanager
def dataset_pass(trainer: object, description: str, total_batches: int, images: int) -> Iterator[Callable[[], None]]:
    """Yields ``advance()``, to call once per batch; see the module docstring. ``trainer`` may be
    None (no bar, no line)."""
    start = time.perf_counter()
    shared = _drawn_rich_bar(trainer) if trainer is not None and bar_wanted(trainer) else None
    own = None
    if shared is None and trainer is not None and bar_wanted(trainer) and sys.stderr.isatty():
        own = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        own.start()
    progress = shared or own
    task = progress.add_task(description, total=total_batches) if progress is not None else None

    def advance() -> None:
        if task is not None:
            progress.update(task, advance=1)
            if shared is not None:  # Lightning's display refreshes only when told
                shared.refresh()

    try:
        yield advance
    finally:
        if task is not None:
            progress.remove_task(task)
        if own is not None:
            own.stop()
    if trainer is not None:
        rank_zero_info(f"{description}, {images} images in {duration_text(time.perf_counter() - start)}")
