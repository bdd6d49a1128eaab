"""The folder of one run: where its ``config.yaml``, pictures, tables, ``summary.json`` and
``checkpoints/`` go, whatever the logger.

- TensorBoard or CSV first: the logger's version folder (``<save_dir>/<name>/version_<n>``), as
  ``trainer.log_dir`` gives it.
- Any other logger first (W&B, MLflow, your own): ``<save_dir>/<name>/<version>``, the folder whose
  ``checkpoints/`` Lightning's ``ModelCheckpoint`` fills (``default_root_dir`` when the logger has no
  ``save_dir``, as for an MLflow server or database). W&B's version is its run id and MLflow's its
  run id, so two runs never share a folder. ``trainer.log_dir`` would give the logger's
  ``save_dir`` here, shared by every run (``.`` for W&B).
- No logger: ``default_root_dir``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

PICTURES = "pictures"


def run_dir(trainer: Any) -> Path:
    """This run's folder (see the module's docstring).

    Safe to call from global rank 0 alone, which is the only rank that writes a run's files: unlike
    ``trainer.log_dir`` it broadcasts nothing. Other ranks may not know a W&B or MLflow run's id:
    use :func:`shared_run_dir` where every rank needs the folder.
    """
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if not trainer.loggers:
        return Path(trainer.default_root_dir)
    logger = trainer.loggers[0]
    if isinstance(logger, (TensorBoardLogger, CSVLogger)):
        return Path(logger.log_dir)
    root = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
    version = logger.version
    version = version if isinstance(version, str) else f"version_{version}"
    return Path(root) / str(logger.name) / version


def shared_run_dir(trainer: Any) -> Path:
    """:func:`run_dir` of global rank 0, on every rank (a collective: every rank must call it)."""
    folder = str(run_dir(trainer)) if trainer.is_global_zero else None
    return Path(trainer.strategy.broadcast(folder))


def picture_dir(trainer: Any) -> Path:
    """``<run folder>/pictures``."""
    return run_dir(trainer) / PICTURES
