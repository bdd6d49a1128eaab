"""The table a run ends with (the quickstart): final evaluation metrics, the run's folder, where
the checkpoints are and where the pictures are. Printed by global rank 0 at the end of ``fit``,
written to the run's folder as ``summary.json`` and sent to every logger in its own form
(:mod:`lightning_mods.run_outputs.to_loggers`): TensorBoard's hyper-parameter view gets the final
metrics as its columns (in place of Lightning's placeholder ``hp_metric`` of -1), W&B its run
summary, MLflow metrics at the last step and the file."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_mods._compat import lightning_private
from lightning_mods.evaluation import metric_names
from lightning_mods.checkpointing.atomic_files import write_text_atomically
from lightning_mods.run_outputs.run_folder import picture_dir, run_dir
from lightning_mods.run_outputs.to_loggers import send_summary
from callbacks.cost import ONCE

DEFAULT_METRICS = (metric_names.KNN_TOP1, metric_names.ONLINE_PROBE_VAL_TOP1, metric_names.EFFECTIVE_RANK,
                   metric_names.RANK_ENTROPY)


def _as_float(value: Any) -> Optional[float]:
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return number if math.isfinite(number) else None


def collect_summary(trainer: Trainer, metrics: Sequence[str]) -> dict[str, Any]:
    """``{"metrics": {name: value or None}, "best_checkpoint", "last_checkpoint", "pictures",
    "log_dir", "epochs" (completed), "steps"}`` of a finished ``fit``. A name the run logged only at
    several settings (``knn/top1@k=10``, ``knn/top1@k=20``) is shown by those."""
    logged = trainer.callback_metrics
    values: dict[str, Optional[float]] = {}
    for name in metrics:
        variants = sorted(n for n in logged if metric_names.base_name(n) == name and n != name)
        for shown in ([name] if name in logged or not variants else []) + variants:
            values[shown] = _as_float(logged[shown]) if shown in logged else None
    best, last = checkpoint_paths(trainer)
    pictures = picture_dir(trainer)
    return {"metrics": values, "best_checkpoint": best, "last_checkpoint": last,
            "pictures": str(pictures) if pictures.is_dir() and any(pictures.iterdir()) else None,
            "log_dir": str(run_dir(trainer)),
            "epochs": int(trainer.current_epoch), "steps": int(trainer.global_step)}


def checkpoint_paths(trainer: Trainer) -> tuple[Optional[str], Optional[str]]:
    """``(best, last)`` checkpoint files of a fit: the best is a monitoring ``ModelCheckpoint``'s
    (None when none monitors a metric: no checkpoint is better than another), the last is a
    ``save_last`` file, else the newest file an unmonitored ``ModelCheckpoint`` kept."""
    checkpoints = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    best = next((cb.best_model_path for cb in checkpoints if cb.monitor and cb.best_model_path), None)
    last = next((cb.last_model_path for cb in checkpoints if cb.last_model_path), None)
    if last is None:  # an unmonitored ModelCheckpoint keeps the newest files: its best is the last one
        last = next((cb.best_model_path for cb in checkpoints if not cb.monitor and cb.best_model_path), None)
    return best, last


def format_value(name: str, value: Optional[float]) -> str:
    """The logged value in its logged unit (accuracies are fractions, as in the progress bar and
    the validate table): accuracies with 4 decimals, other numbers with 4 significant digits."""
    if value is None:
        return "-"
    if metric_names.is_fraction(name):
        return f"{value:.4f}"
    return f"{value:.4g}"


class RunSummary(Callback):
    """Print the final metrics, the checkpoint paths and the pictures folder after ``fit``.

    Args:
        metrics: names of logged metrics to show (missing ones show ``-``).
        title: the table's title.
        summary_file: JSON file written in the log directory (None: no file).
    """
    cost = ONCE

    def __init__(self, metrics: Sequence[str] = DEFAULT_METRICS, title: str = "shortcutlab run summary",
                 summary_file: Optional[str] = "summary.json") -> None:
        super().__init__()
        if isinstance(metrics, str) or not all(isinstance(m, str) and m for m in metrics):
            raise ValueError(f"RunSummary: metrics must be a list of metric names, got {metrics!r}")
        self.metrics = list(metrics)
        self.title = title
        self.summary_file = summary_file
        self.summary: dict[str, Any] = {}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":  # the final metrics take the placeholder's place (send_summary)
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    lightning_private.without_hp_metric_placeholder(logger)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.summary = collect_summary(trainer, self.metrics)
        if not trainer.is_global_zero:
            return
        path = None
        if self.summary_file:
            path = Path(self.summary["log_dir"]) / self.summary_file
            write_text_atomically(path, json.dumps(self.summary, indent=2) + "\n")
        settings = {**dict(getattr(trainer.datamodule, "hparams", None) or {}), **dict(pl_module.hparams)}
        send_summary(trainer, self.summary, settings, path, Path(self.summary["log_dir"]))
        self.print_table()

    def print_table(self) -> None:
        """The rich table of :attr:`summary` on the terminal."""
        from rich.console import Console
        from rich.table import Table

        console = Console()
        terminal = console.is_terminal
        if not terminal:  # a job's log file: the paths whole on one line, to be copied from it
            longest = max((len(str(v)) for v in self.summary.values() if isinstance(v, str)), default=0)
            console = Console(width=max(console.width, longest + 40))
        table = Table(title=self.title, show_header=True, header_style="bold")
        table.add_column("what")
        table.add_column("value", justify="right", overflow="fold" if terminal else "ignore", no_wrap=not terminal)
        for name, value in self.summary["metrics"].items():
            table.add_row(name, format_value(name, value))
        table.add_row("epochs / steps", f"{self.summary['epochs']} / {self.summary['steps']}")
        for label, key in (("run folder", "log_dir"), ("best checkpoint", "best_checkpoint"),
                           ("last checkpoint", "last_checkpoint"),
                           ("pictures", "pictures")):
            table.add_row(label, self.summary[key] or "-", style="dim" if not self.summary[key] else None)
        console.print(table)
