"""What one sweep run left behind, as numbers: its logged metrics and whether it finished.

A run folder ``runs/<experiment>/<name>/`` (``shortcutlab sweep``) holds ``metrics.csv`` (Lightning's
CSVLogger: columns ``epoch``, ``step`` and one per logged metric, each row holding only the
metrics logged at that point), ``sweep.json`` (the command's exit status), ``fit_end.json``
(written when the fit ended normally, :mod:`callbacks.reliability.fit_end_record`) and, after ``--then``,
``probe/`` (the offline linear probe's ``metrics.csv`` and ``fit_end.json``: the evaluation
named ``probe``), and after ``--evaluate NAME=...`` a folder ``NAME/`` of the same kind per
evaluation (fine-tuning, a probe protocol) of the run's checkpoint. A run's *final*
value of a metric is the last value logged for it in file order: after a resume the file goes on
where the checkpoint was, so the last row is the latest.

A run (or an evaluation) counts only once it has ended: the sweep recorded exit status 0, or its
``fit_end.json`` exists (a run of ``sweep --print`` on a cluster has no ``sweep.json``). Metrics
of a run that is still training, was killed, or crashed unrecorded are never averaged in.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from commands._run_folder import sweep_record
from commands._sweep_grid import parse_run_name

METRICS_FILE = "metrics.csv"
SWEEP_RECORD = "sweep.json"
# callbacks.reliability.fit_end_record.FIT_END_FILE (not imported: the report needs no Lightning)
FIT_END_FILE = "fit_end.json"
# metrics logged with on_step and on_epoch get these suffixes; the epoch value is the one reported
EPOCH_SUFFIX = "_epoch"
# lightning_mods.evaluation.over_depth.DEPTH_FILE (not imported: the report needs no torch): one row per
# evaluation and block; its accuracy columns become <name>@best_block and <name>@last_block
DEPTH_FILE = "eval_per_block.csv"
DEPTH_ACCURACIES = ("knn/top1", "online_probe/val_top1", "val/top1")


@dataclass
class Point:
    """One logged value: the ``epoch`` and ``step`` of its row (None where the row has none)."""

    epoch: Optional[int]
    step: Optional[int]
    value: float


@dataclass
class Run:
    """One run folder: its grid values, what it logged, and what went wrong (``problem``)."""

    name: str
    folder: Path
    grid: dict[str, str]
    metrics: dict[str, list[Point]] = field(default_factory=dict)
    # the fits made from the run's checkpoint (sweep --evaluate; --then is the one named "probe"):
    # name -> their logged metrics
    evaluation_metrics: dict[str, dict[str, list[Point]]] = field(default_factory=dict)
    evaluation_problems: dict[str, str] = field(default_factory=dict)
    recorded: bool = False  # has a sweep.json (False: still running, or not made by the sweep)
    # the checkpoint each fit made from the run started from (its config.yaml): "probe" or an evaluation's name
    started_from: dict[str, str] = field(default_factory=dict)
    # why the run is not counted: "missing", "failed" or "unreadable" first, then the detail in
    # parentheses (an evaluation's problem, in evaluation_problems, reads "probe missing ...")
    problem: Optional[str] = None

    @property
    def counted(self) -> bool:
        return self.problem is None

    def logged(self, fit: Optional[str] = None) -> dict[str, list[Point]]:
        """The run's metrics; with ``fit`` the name of an evaluation (``probe``: the ``--then``
        fit), that evaluation's."""
        return self.metrics if fit is None else self.evaluation_metrics.get(fit, {})

    def history(self, metric: str, fit: Optional[str] = None) -> list[Point]:
        """Every value of ``metric`` in file order (``metric_epoch`` when only that was logged)."""
        logged = self.logged(fit)
        return logged.get(metric) or logged.get(metric + EPOCH_SUFFIX) or []

    def last_epoch(self, fit: Optional[str] = None) -> Optional[int]:
        """The last epoch any metric was logged at (None when no row has an epoch)."""
        logged = self.logged(fit)
        return max((p.epoch for points in logged.values() for p in points if p.epoch is not None), default=None)

    def stale_epoch(self, metric: str, fit: Optional[str] = None) -> Optional[int]:
        """The epoch of ``metric``'s final value when the run logged later epochs after it (the
        value predates the end of training: an evaluation cadence that missed the end); else None."""
        points = self.history(metric, fit)
        end = self.last_epoch(fit)
        if not points or points[-1].epoch is None or end is None:
            return None
        return points[-1].epoch if points[-1].epoch < end else None

    def final(self, metric: str, fit: Optional[str] = None) -> Optional[float]:
        """The last logged value of ``metric`` (None when never logged or not counted)."""
        if not self.counted:  # a probe or an evaluation with a problem logged nothing that is read
            return None
        points = self.history(metric, fit)
        return points[-1].value if points else None


def _number(text: Optional[str]) -> Optional[float]:
    if text is None or text.strip() == "":
        return None
    return float(text)


def read_metrics_csv(path: Path) -> dict[str, list[Point]]:
    """``metric -> [Point, ...]`` in file order from a CSVLogger ``metrics.csv`` (empty cells skipped)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            raise ValueError(f"{path}: empty file (expected a CSVLogger header: epoch,step,<metrics>)")
        series: dict[str, list[Point]] = {name: [] for name in reader.fieldnames if name not in ("epoch", "step")}
        for line, row in enumerate(reader, start=2):
            try:
                epoch, step = _number(row.get("epoch")), _number(row.get("step"))
                for name in series:
                    value = _number(row.get(name))
                    if value is not None:
                        series[name].append(Point(None if epoch is None else int(epoch),
                                                  None if step is None else int(step), value))
            except ValueError as err:
                raise ValueError(f"{path}, line {line}: not a number ({err})") from None
    return {name: points for name, points in series.items() if points}


def read_depth_csv(path: Path) -> dict[str, list[Point]]:
    """From an ``eval_per_block.csv``, per accuracy column and evaluation: the best block's value
    (``<name>@best_block``) and the last block's (``<name>@last_block``), as logged series."""
    evaluations: dict[tuple[int, int], dict[str, dict[int, float]]] = {}
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                key, block = (int(row["step"]), int(row["epoch"])), int(row["block"])
                for name, value in row.items():
                    if name.split("@", 1)[0] in DEPTH_ACCURACIES and value not in (None, ""):
                        evaluations.setdefault(key, {}).setdefault(name, {})[block] = float(value)
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{path}, line {line}: not an eval_per_block row ({err})") from None
    series: dict[str, list[Point]] = {}
    for (step, epoch), columns in sorted(evaluations.items()):
        for name, by_block in columns.items():
            finite = [v for v in by_block.values() if v == v]
            for where, value in (("best_block", max(finite) if finite else float("nan")),
                                 ("last_block", by_block[max(by_block)])):
                variant = f"{name},{where}" if "@" in name else f"{name}@{where}"
                series.setdefault(variant, []).append(Point(epoch, step, value))
    return series


def _exit_status(record: dict, key: str) -> Optional[int]:
    status = record.get(key)
    return status if isinstance(status, int) else None


def checkpoint_of(folder: Path) -> Optional[str]:
    """The ``model.checkpoint`` a fit in ``folder`` started from, by its ``config.yaml`` (None: no
    such fit, or one that names none)."""
    import yaml

    try:
        config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    model = config.get("model") or {}
    checkpoint = (model.get("init_args") or {}).get("checkpoint", model.get("checkpoint"))
    return None if checkpoint is None else str(checkpoint)


def read_follow_up(folder: Path, label: str, status: Optional[int],
                   commanded: bool) -> tuple[dict[str, list[Point]], Optional[str]]:
    """``(metrics, problem)`` of a fit made from the run's checkpoint in ``folder`` (the offline
    probe, or a named evaluation), given its exit status as the sweep recorded it and whether the
    sweep started it; a problem reads ``"<label> failed (...)"``, ``incomplete``, ``unreadable`` or
    ``missing``; no folder and never started: no metrics, no problem."""
    metrics_file = folder / METRICS_FILE
    if status not in (None, 0):
        return {}, f"{label} failed (exit status {status})"
    if metrics_file.is_file() and status is None and not (folder / FIT_END_FILE).is_file():
        return {}, (f"{label} incomplete (no exit status in {SWEEP_RECORD} and no {folder.name}/{FIT_END_FILE}: "
                    "still training, killed, or crashed)")
    if metrics_file.is_file():
        try:
            metrics = read_metrics_csv(metrics_file)
            if (folder / DEPTH_FILE).is_file():
                metrics.update(read_depth_csv(folder / DEPTH_FILE))
            return metrics, None
        except (ValueError, csv.Error) as err:
            return {}, f"{label} unreadable ({err})"
    if commanded:
        return {}, f"{label} missing (no {folder.name}/{METRICS_FILE})"
    return {}, None


def read_run(folder: Path) -> Run:
    """The run in ``folder``; a missing or unreadable ``metrics.csv`` or a non-zero exit status in
    ``sweep.json`` sets ``problem`` instead of raising."""
    run = Run(folder.name, folder, parse_run_name(folder.name))
    record_file = folder / SWEEP_RECORD
    record: dict = {}
    if record_file.is_file():
        try:
            record = json.loads(record_file.read_text())
            run.recorded = True
        except json.JSONDecodeError:
            run.problem = f"unreadable ({SWEEP_RECORD})"
    status = _exit_status(record, "status")
    if status not in (None, 0):
        run.problem = f"failed (exit status {status}, see {folder / 'sweep.log'})"
    elif not (folder / METRICS_FILE).is_file():
        run.problem = f"missing (no {METRICS_FILE})"
    elif status is None and not (folder / FIT_END_FILE).is_file():
        run.problem = (f"incomplete (no exit status in {SWEEP_RECORD} and no {FIT_END_FILE}: still training, "
                       "killed, or crashed)")
    if run.problem is None:
        try:
            run.metrics = read_metrics_csv(folder / METRICS_FILE)
            if (folder / DEPTH_FILE).is_file():
                run.metrics.update(read_depth_csv(folder / DEPTH_FILE))
        except (ValueError, csv.Error) as err:
            run.problem = f"unreadable ({err})"
    fits = sorted(f for f in folder.iterdir() if f.is_dir()) if folder.is_dir() else []  # the fits from its checkpoint
    for follow_up in fits:
        checkpoint = checkpoint_of(follow_up)
        if checkpoint is not None:
            run.started_from[follow_up.name] = checkpoint
    record = sweep_record(record)
    evaluations = record.get("evaluations") if isinstance(record.get("evaluations"), dict) else {}
    names = set(evaluations) | {f.name for f in fits if (f / METRICS_FILE).is_file() and not f.name.startswith(".")}
    for name in sorted(names):
        entry = evaluations.get(name) if isinstance(evaluations.get(name), dict) else {}
        metrics, problem = read_follow_up(folder / name, name, _exit_status(entry, "status"), "command" in entry)
        run.evaluation_metrics[name] = metrics
        if problem is not None:
            run.evaluation_problems[name] = problem
    return run
