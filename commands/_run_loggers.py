"""The loggers of one run of a sweep: the ones its configs name, plus the CSV logger the report reads.

Every run of a sweep logs to its own folder ``<runs-dir>/<experiment>/<run>``: a CSV logger comes
first there (``metrics.csv``, read by ``shortcutlab report``; the first logger names the run's
folder, so the checkpoints, pictures and tables land there too). The loggers the configs chose
follow, each told which sweep and which run it logs:

- TensorBoard writes its events into the run's folder;
- W&B runs of one sweep share a group named after the experiment, each named after its run
  (``alpha_min=0.6,seed=1``; an evaluation ``alpha_min=0.6,seed=1/probe``);
- MLflow runs of one sweep share an experiment named after it, each named after its run;
- any other logger is kept as configured (a CSV logger of the configs is replaced by the run's).

Configs that name no logger get Lightning's default, TensorBoard; ``logger: false`` leaves only
the CSV logger the report needs.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any


def as_entries(logger: Any) -> list[dict]:
    """The parsed ``trainer.logger`` (a class entry, a list of them, ``True``/``None`` for Lightning's
    default or ``False``) as ``{"class_path", "init_args"}`` dicts."""
    if logger is False:
        return []
    if logger is None or logger is True:
        return [{"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {}}]
    entries = logger if isinstance(logger, (list, tuple)) else [logger]
    plain = [entry.as_dict() if hasattr(entry, "as_dict") else dict(entry) for entry in entries]
    return [{"class_path": entry["class_path"], "init_args": dict(entry.get("init_args") or {})} for entry in plain]


def _is(entry: dict, name: str) -> bool:
    """Whether the entry's class is Lightning's logger ``name`` or a subclass of it."""
    from lightning.pytorch import loggers

    module, _, cls = entry["class_path"].rpartition(".")
    try:
        return issubclass(getattr(importlib.import_module(module), cls), getattr(loggers, name))
    except (ImportError, AttributeError, TypeError):
        return False


def run_loggers(logger: Any, save_dir: Path, version: str, experiment: str) -> list[dict]:
    """The loggers of the run ``save_dir/version`` of the sweep ``experiment``, given the parsed
    ``trainer.logger`` of its configs: the run's CSV logger first, then the configs' loggers."""
    folder = {"save_dir": str(save_dir), "name": "", "version": version}
    chosen = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": folder}]
    for entry in as_entries(logger):
        settings = entry["init_args"]
        if _is(entry, "CSVLogger"):
            continue
        if _is(entry, "TensorBoardLogger"):
            settings.update(folder)
        elif _is(entry, "WandbLogger"):
            settings.update(group=experiment, name=version)
        elif _is(entry, "MLFlowLogger"):
            settings.update(experiment_name=experiment, run_name=version)
        chosen.append(entry)
    return chosen
