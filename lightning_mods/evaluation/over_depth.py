"""Evaluation over depth: what each block learned, in one file and one picture.

The kNN (:class:`~callbacks.measurement.knn.KNNEvaluator`), the online probe
(:class:`~callbacks.measurement.online_probe.OnlineLinearProbe`) and the offline
:class:`~lightning_mods.linear_probe.LinearProbe` take ``blocks``: ``None`` (the default: the
evaluation features only, today's metrics), ``"all"`` or a list of block indices (1 = the block
nearest the input, -1 = the last). Every chosen block comes from the same forward pass
(``forward_intermediates``, the pooled output of each block). Each of them, and
:class:`~callbacks.measurement.effective_rank.EffectiveRank` with ``per_block``, keeps one row per evaluation
and block (:meth:`depth_rows`); at the end of every validation global rank 0 writes them all once, merged by
``(epoch, step, block)``, to ``<log_dir>/eval_per_block.csv`` and draws ``eval/over_depth``:
accuracy against block index (kNN solid, probes dashed), one line per evaluation coloured by
epoch, the latest in black, and the mean feature norm of each block's pooled output on a
second axis. The file is rewritten whole from the callbacks' states, so a resumed run's file
holds exactly the evaluations before its checkpoint and those after, none twice.

The columns are the metric names (``knn/top1``, ``knn/top1@k=10``, ``online_probe/val_top1``,
``val/top1`` of the offline probe, ``rank/effective_rank``) and ``feature/norm``;
``shortcutlab report`` reads the last evaluation's best block and last block of each accuracy.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from lightning.pytorch.trainer.states import TrainerFn

from torch import nn

from lightning_mods.evaluation import metric_names
from lightning_mods.checkpointing.atomic_files import write_text_atomically
from lightning_mods.pictures.grids import log_picture
from lightning_mods.run_outputs.run_folder import run_dir
from lightning_mods.run_outputs.to_loggers import send_table

DEPTH_FILE = "eval_per_block.csv"
KEY_COLUMNS = ("epoch", "step", "block")
ACCURACIES = (metric_names.KNN_TOP1, metric_names.ONLINE_PROBE_VAL_TOP1, metric_names.VAL_TOP1)
BlockSpec = Union[None, str, Sequence[int]]


def check_blocks(owner: str, blocks: BlockSpec) -> BlockSpec:
    """``blocks`` as given when it is None, ``"all"`` or a non-empty list of distinct non-zero
    integers (1-based, negative from the end), else a one-line ValueError naming ``owner``."""
    if blocks is None or blocks == "all":
        return blocks
    if isinstance(blocks, (list, tuple)) and blocks and all(
            isinstance(b, int) and not isinstance(b, bool) and b != 0 for b in blocks) and len(set(blocks)) == len(blocks):
        return list(blocks)
    raise ValueError(f"{owner}: blocks must be null (the evaluation features only), 'all' or a list of distinct "
                     f"block indices (1 = nearest the input, -1 = the last), got {blocks!r}")


def resolve_blocks(owner: str, blocks: BlockSpec, num_blocks: int) -> list[int]:
    """The chosen blocks as sorted 1-based indices into ``num_blocks`` blocks ([] for None)."""
    if blocks is None:
        return []
    if blocks == "all":
        return list(range(1, num_blocks + 1))
    resolved = sorted({b if b > 0 else num_blocks + 1 + b for b in blocks})
    if resolved[0] < 1 or resolved[-1] > num_blocks:
        raise ValueError(f"{owner}: blocks {list(blocks)} do not exist: the model has {num_blocks} blocks "
                         f"(1 to {num_blocks}, or -1 to -{num_blocks})")
    return resolved


def merged_rows(trainer: Any) -> list[dict[str, Any]]:
    """Every callback's (and the module's) ``depth_rows(trainer)``, merged by ``(epoch, step,
    block)`` in step order."""
    table: dict[tuple, dict[str, Any]] = {}
    for callback in [*trainer.callbacks, trainer.lightning_module]:
        rows = getattr(callback, "depth_rows", None)
        if not callable(rows):
            continue
        for row in rows(trainer):
            key = tuple(row[c] for c in KEY_COLUMNS)
            table.setdefault(key, dict(zip(KEY_COLUMNS, key))).update(row)
    return [table[key] for key in sorted(table, key=lambda k: (k[1], k[0], k[2]))]


def write_table(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as a CSV: the key columns, then every value column (sorted), empty where a row has none."""
    columns = list(KEY_COLUMNS) + sorted({c for row in rows for c in row} - set(KEY_COLUMNS))
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns, restval="")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: repr(v) if isinstance(v, float) else v for k, v in row.items()})
    return write_text_atomically(path, text.getvalue())  # a reader never sees half a file


def read_table(path: Path) -> list[dict[str, Any]]:
    """The rows of an ``eval_per_block.csv`` (numbers as int / float, empty cells left out)."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            parsed: dict[str, Any] = {}
            for key, value in row.items():
                if value in (None, ""):
                    continue
                parsed[key] = int(value) if key in KEY_COLUMNS else float(value)
            rows.append(parsed)
    return rows


def last_evaluation(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the latest evaluation (the highest step, then epoch), by block."""
    if not rows:
        return []
    last = max((row["step"], row["epoch"]) for row in rows)
    return sorted((row for row in rows if (row["step"], row["epoch"]) == last), key=lambda row: row["block"])


def accuracy_columns(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The columns of ``rows`` that are accuracies (kNN, probes; variants included), sorted."""
    return sorted({c for row in rows for c in row if metric_names.base_name(c) in ACCURACIES})


class DepthRows:
    """The per-block rows of one contributor: every evaluation of ``fit`` (:attr:`depth_history`,
    which the contributor keeps in its checkpoint state) or the last ``validate``'s (Lightning
    does not restore a fit's callback states there). A contributor keeps one as ``over_depth``
    and answers ``depth_rows(trainer)`` from it; :attr:`unwritten` says it has rows the table
    does not show yet."""

    def __init__(self) -> None:
        self.depth_history: list[dict[str, Any]] = []
        self.validate_rows: list[dict[str, Any]] = []
        self.unwritten = False

    def record(self, trainer: Any, rows: list[dict[str, Any]]) -> None:
        """Keep this evaluation's ``rows``; the table is written at the end of the validation."""
        if trainer.state.fn == TrainerFn.FITTING:
            self.depth_history += rows
        else:
            self.validate_rows = rows
        self.unwritten = True

    def rows(self, trainer: Any) -> list[dict[str, Any]]:
        return self.depth_history if trainer.state.fn == TrainerFn.FITTING else self.validate_rows


def contributors(trainer: Any) -> list[Any]:
    """The callbacks (and the module) that keep per-block rows (an ``over_depth`` :class:`DepthRows`)."""
    return [c for c in [*trainer.callbacks, trainer.lightning_module] if isinstance(getattr(c, "over_depth", None),
                                                                                   DepthRows)]


def write_pending(trainer: Any, title: str = "evaluation over depth") -> Optional[Path]:
    """:func:`write_over_depth` once per validation, when a contributor has unwritten rows: every
    contributor calls it in its ``on_validation_end``, after all of them recorded their rows
    (``on_validation_epoch_end``); the first call writes, the others find nothing new."""
    found = contributors(trainer)
    if not any(c.over_depth.unwritten for c in found):
        return None
    for contributor in found:
        contributor.over_depth.unwritten = False
    return write_over_depth(trainer, title)


def write_over_depth(trainer: Any, title: str = "evaluation over depth") -> Optional[Path]:
    """Rank 0: rewrite ``eval_per_block.csv`` from every callback's rows and draw ``eval/over_depth``."""
    if not trainer.is_global_zero:
        return None
    rows = merged_rows(trainer)
    if not rows:
        return None
    path = write_table(run_dir(trainer) / DEPTH_FILE, rows)
    send_table(trainer, path, trainer.global_step, run_dir(trainer))
    if accuracy_columns(rows) or any(metric_names.FEATURE_NORM in row for row in rows):
        log_picture(trainer, "eval/over_depth", draw_over_depth(rows, title))
    return path


def draw_over_depth(rows: list[dict[str, Any]], title: str = "evaluation over depth",
                    legend_lines: int = 8):
    """Accuracy against block index, one line per evaluation and accuracy column, coloured by
    epoch (the latest in black with markers; a colour bar beyond ``legend_lines`` evaluations),
    and the feature norm of the latest evaluation on a second axis. A matplotlib ``Figure``."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    evaluations = sorted({(row["step"], row["epoch"]) for row in rows})
    epochs = [epoch for _, epoch in evaluations]
    shades = ScalarMappable(Normalize(min(epochs), max(max(epochs), min(epochs) + 1)), colormaps["viridis"])
    fig = Figure(figsize=(6.4, 4.8), layout="constrained")
    ax = fig.add_subplot()
    styles = ["-", "--", "-.", ":"]
    columns = accuracy_columns(rows)
    named = len(evaluations) <= legend_lines
    for c, column in enumerate(columns):
        for i, (step, epoch) in enumerate(evaluations):
            points = sorted((row["block"], row[column]) for row in rows
                            if (row["step"], row["epoch"]) == (step, epoch) and column in row)
            if not points:
                continue
            latest = i == len(evaluations) - 1
            label = f"{column}, epoch {epoch}" if (named or latest) else None
            ax.plot([b for b, _ in points], [100 * v for _, v in points], linestyle=styles[c % len(styles)],
                    marker="o" if latest else None, linewidth=2.0 if latest else 1.1,
                    color="black" if latest else shades.to_rgba(epoch), label=label)
    ax.set_xlabel("block index (1 = nearest the input)")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    latest_rows = last_evaluation(rows)
    norms = [(row["block"], row[metric_names.FEATURE_NORM]) for row in latest_rows
             if metric_names.FEATURE_NORM in row and math.isfinite(row[metric_names.FEATURE_NORM])]
    handles, labels = ax.get_legend_handles_labels()
    if norms:
        right = ax.twinx()
        line, = right.plot([b for b, _ in norms], [n for _, n in norms], color="tab:red", linestyle=":",
                           marker="s", markersize=3, label=f"feature norm, epoch {latest_rows[0]['epoch']}")
        right.set_ylabel("mean L2 norm of the pooled block output", color="tab:red")
        handles, labels = handles + [line], labels + [line.get_label()]
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize="x-small")
    if not named and columns:
        fig.colorbar(shades, ax=ax, label="epoch", location="bottom")
    return fig
