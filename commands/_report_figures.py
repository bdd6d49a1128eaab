"""The figures of ``shortcutlab report`` (PNG, matplotlib's Agg canvas; no pyplot state).

- ``metrics_vs_<key>.png``: each metric against the first grid key (alpha_min), mean ± std over seeds;
- ``effective_rank_over_epochs.png``: the effective rank at each evaluation, one line per group
  (mean over seeds, std shaded);
- ``probe_vs_effective_rank.png``: one point per run, coloured by group, Pearson r in the title
  (the decay paper's Figure 5c).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

if TYPE_CHECKING:
    from commands._report_groups import Group, ReportedMetric
    from commands._run_metrics import Run

DPI = 120


def _numeric(values: list[str]) -> Optional[list[float]]:
    try:
        return [float(v) for v in values]
    except ValueError:
        return None


def _colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def metric_vs_group_figure(out: Path, group_keys: list[str], groups: list["Group"],
                           metrics: list["ReportedMetric"]) -> Path:
    """One panel per metric: mean ± std over seeds against the first group key; the other group
    keys (if any) are separate lines."""
    x_key, series_keys = group_keys[0], group_keys[1:]
    fig = Figure(figsize=(4.0 * len(metrics), 3.6), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    series: dict[tuple, list["Group"]] = {}
    for group in groups:
        series.setdefault(tuple(group.key[k] for k in series_keys), []).append(group)
    colours = _colours(len(series))
    for ax, metric in zip(axes, metrics):
        for colour, (values, members) in zip(colours, series.items()):
            xs_text = [g.key[x_key] for g in members]
            numeric = _numeric(xs_text)
            xs = numeric if numeric is not None else list(range(len(xs_text)))
            summaries = [g.summary(metric) for g in members]
            kept = [(x, s) for x, s in zip(xs, summaries) if s is not None]
            if not kept:
                continue
            label = ", ".join(f"{k}={v}" for k, v in zip(series_keys, values)) or "mean ± std over seeds"
            ax.errorbar([x for x, _ in kept], [metric.shown(s.mean) for _, s in kept],
                        yerr=[metric.shown(s.std or 0.0) for _, s in kept], marker="o", capsize=4,
                        color=colour, label=label)
            if numeric is None:
                ax.set_xticks(xs, xs_text)
        ax.set_title(metric.label)
        ax.set_xlabel(x_key)
        ax.set_ylabel(metric.label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"final metrics against {x_key} (error bars: std over seeds)")
    return _save(fig, out / f"metrics_vs_{x_key}.png")


def _mean_curve(runs: list["Run"], metric: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(epochs trained, mean, std)`` over the runs at every epoch any of them evaluated (the last
    value per epoch, so a resumed run counts once; std 0 where one run has the epoch)."""
    per_epoch: dict[int, list[float]] = {}
    for run in runs:
        values = {p.epoch: p.value for p in run.history(metric) if p.epoch is not None}
        for epoch, value in values.items():
            per_epoch.setdefault(epoch, []).append(value)
    epochs = sorted(per_epoch)
    means = np.array([np.mean(per_epoch[e]) for e in epochs], dtype=np.float64)
    stds = np.array([np.std(per_epoch[e], ddof=1) if len(per_epoch[e]) > 1 else 0.0 for e in epochs])
    return np.array(epochs, dtype=np.float64) + 1, means, stds


def rank_over_epochs_figure(out: Path, groups: list["Group"], metric: "ReportedMetric") -> Path:
    """The effective rank at each evaluation, one line per group (mean over seeds, std shaded)."""
    fig = Figure(figsize=(6.0, 4.0), layout="constrained")
    ax = fig.subplots()
    for colour, group in zip(_colours(len(groups)), groups):
        epochs, means, stds = _mean_curve(group.counted, metric.name)
        if len(epochs) == 0:
            continue
        ax.plot(epochs, means, marker="o", color=colour, label=f"{group.label} (n={len(group.counted)})")
        ax.fill_between(epochs, means - stds, means + stds, color=colour, alpha=0.2)
    ax.set_title(f"{metric.label} over training (mean over seeds, std shaded)")
    ax.set_xlabel("epochs trained")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"{metric.label} (exp of singular-value entropy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, out / "effective_rank_over_epochs.png")


def probe_vs_rank_figure(out: Path, groups: list["Group"], points: list[tuple["Run", float, float]],
                         probe: "ReportedMetric", r: Optional[float]) -> Path:
    """Probe accuracy against effective rank, one point per run coloured by its group."""
    fig = Figure(figsize=(6.0, 4.4), layout="constrained")
    ax = fig.subplots()
    for colour, group in zip(_colours(len(groups)), groups):
        names = {run.name for run in group.runs}
        mine = [(rank, acc) for run, rank, acc in points if run.name in names]
        if mine:
            ax.scatter([rank for rank, _ in mine], [probe.shown(acc) for _, acc in mine], color=colour,
                       s=40, edgecolors="black", linewidths=0.5, label=group.label)
    r_text = "undefined" if r is None else f"{r:.3f}"
    ax.set_title(f"{probe.label} vs effective rank: Pearson r = {r_text} (n = {len(points)} runs)")
    ax.set_xlabel("effective rank (final, exp of singular-value entropy)")
    ax.set_ylabel(probe.label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", title="group")
    return _save(fig, out / "probe_vs_effective_rank.png")
