"""Send what a run shows to every configured logger, in that logger's own form.

The files come first and always: every picture (``pictures/*.png``), table (``*.csv``), the
``config.yaml`` and ``summary.json`` lie in the run's folder (:mod:`.run_folder`) whatever the
logger. Then each logger of the trainer gets them as it shows them:

============  =====================  ==========================  ==================================
logger        pictures               tables                      final summary
============  =====================  ==========================  ==================================
TensorBoard   images (``add_image``) the files                   hyper-parameters with the final
                                                                 metrics as columns (``hparams``)
CSV           the files              the files                   the files
W&B           images (``log_image``) tables (``log_table``)      the run summary; the run's files
                                                                 hold ``shortcutlab/config.yaml``
MLflow        images (``log_image``) tables (``log_table``, one   metrics at the last step,
              by key and step        JSON a step) and the CSVs   ``summary.json`` and ``config.yaml``
============  =====================  ==========================  ==================================

A logger of another kind gets only the files, and one line (once per kind and process) says so.
Everything here runs on global rank 0 only: W&B and MLflow runs exist there alone.
"""
from __future__ import annotations

import csv
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np

log = logging.getLogger(__name__)
_told: set[str] = set()  # the logger kinds the files-only line was printed for
_tables_logged: set[tuple[str, str]] = set()  # (MLflow run, table file) already written


def _kind(logger: Any) -> Optional[str]:
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    for kind, cls in (("tensorboard", TensorBoardLogger), ("csv", CSVLogger), ("wandb", WandbLogger),
                      ("mlflow", MLFlowLogger)):
        if isinstance(logger, cls):
            return kind
    return None


def _loggers(trainer: Any, run_folder: Path) -> list[tuple[str, Any]]:
    """``(kind, logger)`` of the loggers the package writes to; one line for each other kind."""
    known = []
    for logger in trainer.loggers:
        kind = _kind(logger)
        if kind is not None:
            known.append((kind, logger))
            continue
        name = type(logger).__name__
        if name not in _told:
            _told.add(name)
            log.warning(f"{name} gets no pictures, tables or summary from shortcutlab (TensorBoard, CSV, W&B and "
                        f"MLflow do); they are files in {run_folder}")
    return known


def mlflow_name(name: str) -> str:
    """``name`` as MLflow takes a metric or image key: the characters it refuses dropped, as
    Lightning's ``MLFlowLogger.log_metrics`` drops them (``knn/top1@k=10`` -> ``knn/top1k10``)."""
    return re.sub(r"[^a-zA-Z0-9_/. -]+", "", name)


def send_image(trainer: Any, tag: str, image: np.ndarray, step: int, run_folder: Path) -> None:
    """An ``H x W x 3`` uint8 picture, already saved as a file, to every logger."""
    for kind, logger in _loggers(trainer, run_folder):
        if kind == "tensorboard":
            logger.experiment.add_image(tag, image, global_step=step, dataformats="HWC")
        elif kind == "wandb":
            logger.log_image(key=tag, images=[image], step=step)
        elif kind == "mlflow":
            logger.experiment.log_image(logger.run_id, image, key=mlflow_name(tag), step=step)


def _cell(text: str) -> Any:
    """A CSV cell as a number where it is one (empty: None)."""
    if text == "":
        return None
    for parse in (int, float):
        try:
            return parse(text)
        except ValueError:
            pass
    return text


def read_csv(path: Path) -> tuple[list[str], list[list[Any]]]:
    """``(columns, rows)`` of a CSV file, numbers parsed."""
    with open(path, newline="") as f:
        reader = csv.reader(f)
        columns = next(reader, [])
        return columns, [[_cell(cell) for cell in row] for row in reader]


def send_table(trainer: Any, path: Path, step: int, run_folder: Path) -> None:
    """The CSV table at ``path`` (written whole just before) to every logger that shows tables, by
    the file's name (``eval_per_block``)."""
    targets = [(kind, logger) for kind, logger in _loggers(trainer, run_folder) if kind in ("wandb", "mlflow")]
    if not targets:
        return
    columns, data = read_csv(path)
    for kind, logger in targets:
        if kind == "wandb":
            logger.log_table(key=path.stem, columns=columns, data=data, step=step)
        else:
            _mlflow_table(logger, path, columns, data, step)


def _mlflow_table(logger: Any, path: Path, columns: list[str], data: list[list[Any]], step: int) -> None:
    """The whole table as ``tables/<name>_step<step>.json`` (MLflow's ``log_table``, which appends to
    a file of the same name: a table rewritten at the same step replaces its file instead) and the
    latest CSV as ``tables/<name>.csv``."""
    client, run_id = logger.experiment, logger.run_id
    artifact = f"tables/{path.stem}_step{step:07d}.json"
    if (run_id, artifact) in _tables_logged:
        client.log_dict(run_id, {"columns": columns, "data": data}, artifact)
    else:
        client.log_table(run_id, data={c: [row[i] for row in data] for i, c in enumerate(columns)},
                         artifact_file=artifact)
        _tables_logged.add((run_id, artifact))
    client.log_artifact(run_id, str(path), "tables")


def send_file(trainer: Any, path: Path, run_folder: Path) -> None:
    """A file of the run's folder (``config.yaml``) to the loggers that keep files."""
    for kind, logger in _loggers(trainer, run_folder):
        if kind == "wandb":  # a copy in the run's files, apart from W&B's own config.yaml there
            files = Path(logger.experiment.dir)
            copy = files / "shortcutlab" / path.name
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)
            logger.experiment.save(str(copy), base_path=str(files), policy="now")
        elif kind == "mlflow":
            logger.experiment.log_artifact(logger.run_id, str(path))


def send_summary(trainer: Any, summary: Mapping[str, Any], settings: Mapping[str, Any], path: Optional[Path],
                 run_folder: Path) -> None:
    """The final summary (:class:`~callbacks.reporting.run_summary.RunSummary`'s: its ``metrics``,
    ``epochs``, ``steps``, paths), written to ``path`` (``summary.json``) when given, to every logger."""
    final = {name: value for name, value in summary["metrics"].items() if value is not None}
    step = int(summary["steps"])
    for kind, logger in _loggers(trainer, run_folder):
        if kind == "tensorboard" and final:
            logger.log_hyperparams(dict(settings), metrics=final, step=step)
        elif kind == "wandb":
            logger.experiment.summary.update({**final, "epochs": summary["epochs"], "steps": step,
                                              "run_folder": str(run_folder)})
        elif kind == "mlflow":
            client, run_id = logger.experiment, logger.run_id
            for name, value in final.items():
                client.log_metric(run_id, mlflow_name(name), value, step=step)
            client.set_tag(run_id, "run_folder", str(run_folder))
            if path is not None:
                client.log_artifact(run_id, str(path))
            else:
                client.log_text(run_id, json.dumps(dict(summary), indent=2) + "\n", "summary.json")
