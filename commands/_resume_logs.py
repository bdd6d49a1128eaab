"""A fit resumed from a checkpoint logs on in the folder the checkpoint was written in: one run,
one curve in TensorBoard, one ``metrics.csv`` (a new ``version_<n+1>`` split the run in two).

Only a logger given no version of its own is continued, and only when the checkpoint lies in one
of its ``version_<n>`` folders (a sweep names its runs' versions itself). Lightning's CSVLogger
deletes an existing ``metrics.csv`` when it starts: the file is kept aside as
``metrics.before_resume.csv`` first, and its rows from before the checkpoint are put back in front
of the resumed rows when the fit ends (a fit that fails leaves the file aside; the next resume
merges it in, so no logged row is lost)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from commands._run_folder import merge_metrics_csv
from lightning_mods._compat import lightning_private

ASIDE = "metrics.before_resume.csv"


def checkpoint_version(logger: Any, ckpt_path: str) -> Optional[int]:
    """``n`` when ``ckpt_path`` lies in the logger's ``version_<n>`` folder, else None."""
    try:
        relative = Path(ckpt_path).resolve().relative_to(Path(logger.root_dir).resolve())
    except ValueError:
        return None
    match = re.fullmatch(r"version_(\d+)", relative.parts[0]) if len(relative.parts) > 1 else None
    return int(match.group(1)) if match else None


def continue_logger_versions(trainer: Any, ckpt_path: Optional[str]) -> list[Path]:
    """Point the trainer's unversioned TensorBoard and CSV loggers at the checkpoint's version;
    returns the CSV folders whose ``metrics.csv`` was kept aside (for :func:`merge_kept_metrics`)."""
    kept = []
    if not ckpt_path:
        return kept
    for logger in trainer.loggers:
        if not isinstance(logger, (TensorBoardLogger, CSVLogger)) or lightning_private.logger_version_given(logger):
            continue
        version = checkpoint_version(logger, ckpt_path)
        if version is None:
            continue
        lightning_private.set_logger_version(logger, version)
        if isinstance(logger, CSVLogger) and trainer.is_global_zero:
            folder = Path(logger.root_dir) / f"version_{version}"
            keep_metrics_aside(folder)
            kept.append(folder)
    return kept


def keep_metrics_aside(folder: Path) -> None:
    """Move ``metrics.csv`` to :data:`ASIDE` (merging in what an earlier failed resume left there)."""
    metrics, aside = folder / "metrics.csv", folder / ASIDE
    if not metrics.is_file():
        return
    if aside.is_file():
        merge_metrics_csv(aside.read_text(), metrics)
    os.replace(metrics, aside)


def merge_kept_metrics(folders: list[Path]) -> None:
    """Put the kept rows back in front of the resumed fit's ``metrics.csv``."""
    for folder in folders:
        aside = folder / ASIDE
        if aside.is_file():
            merge_metrics_csv(aside.read_text(), folder / "metrics.csv")
            aside.unlink()
