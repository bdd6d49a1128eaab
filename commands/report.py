"""Turn a sweep's runs into the paper's table and figures.

    shortcutlab report runs/quickstart_seeds            # -> runs/quickstart_seeds/report/

Reads every run folder of the experiment (``shortcutlab sweep``), groups the runs by all grid
keys except ``seed`` and writes ``report.md`` (one row per group: kNN top-1, the top-1 of each
evaluation of the run's checkpoint (``sweep --evaluate``: fine-tuning and the linear-probe
protocols side by side, the decay paper's Table 1), online probe and offline probe top-1 in
percent, a classifier's own val top-1, and the effective rank, each mean ± sample std over the
seeds), ``report.json`` (the raw numbers) and the figures: each metric against
alpha_min, the effective rank over epochs per alpha_min, and probe accuracy against effective
rank with the Pearson r (the decay paper's Figure 5c). A run's value of a metric is the last
one logged in its ``metrics.csv``. A run the sweep planned but never started, one without
``metrics.csv``, one the sweep recorded as failed, and one that has not ended (no exit status and
no ``fit_end.json``: still training, killed, crashed) is listed and not counted; a value logged
before its run's last epoch is counted and listed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

import lightning_mods.exit_statuses as exit_statuses
from commands._report_groups import Group, ReportedMetric, Summary
from commands._run_metrics import Run, read_run
from lightning_mods.evaluation import metric_names
from lightning_mods.checkpointing.atomic_files import write_text_atomically
from commands._run_folder import FOLLOW_UP_DIR, read_plan
from commands._sweep_grid import parse_run_name, short_name

SEED_KEY = short_name("seed_everything")  # "seed" in run names
REPORT_DIR = "report"


KNN = ReportedMetric("knn/top1", "kNN top-1 (%)", percent=True)
ONLINE_PROBE = ReportedMetric("online_probe/val_top1", "online probe top-1 (%)", percent=True)
OFFLINE_PROBE = ReportedMetric("val/top1", "offline probe top-1 (%)", percent=True, fit=FOLLOW_UP_DIR)
EFFECTIVE_RANK = ReportedMetric("rank/effective_rank", "effective rank exp(H)", percent=False)
# the decay paper, section 6: the decay paper writes the entropy H itself and calls it the effective rank
RANK_ENTROPY = ReportedMetric("rank/entropy", "rank entropy H", percent=False)
SUPERVISED = ReportedMetric("val/top1", "val top-1 (%)", percent=True)  # a classifier's own accuracy
TABLE_METRICS = (KNN, ONLINE_PROBE, OFFLINE_PROBE, SUPERVISED, EFFECTIVE_RANK, RANK_ENTROPY)
# in report.json only
EXTRA_METRICS = (ReportedMetric("train/loss", "train loss", percent=False),
                 ReportedMetric("val/loss", "val loss", percent=False))


def pearson_r(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    """Pearson's correlation of ``x`` and ``y`` (None for fewer than 2 points or a constant)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2:
        return None
    dx, dy = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float(dx @ dx) * float(dy @ dy))
    return float(dx @ dy) / denominator if denominator > 0 else None


def _sort_key(value: str) -> tuple:
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)


def find_runs(experiment: Path, skip: Path) -> list[Run]:
    """Every run folder (named ``key=value,...`` or ``run``) of ``experiment``, except ``skip``."""
    if not experiment.is_dir():
        raise FileNotFoundError(f"no experiment folder '{experiment}' (expected runs/<experiment>, "
                                "made by shortcutlab sweep)")
    folders = [f for f in sorted(experiment.iterdir()) if f.is_dir() and f.resolve() != skip.resolve()
               and (f.name == "run" or ("=" in f.name and all("=" in part for part in f.name.split(","))))]
    if not folders:
        raise ValueError(f"no runs in '{experiment}' (expected folders named like alpha_min=0.6,seed=0, "
                         "made by shortcutlab sweep)")
    runs = [read_run(f) for f in folders]
    on_disk = {f.name for f in folders}
    for name in read_plan(experiment):
        if name not in on_disk:
            runs.append(Run(name, experiment / name, parse_run_name(name), problem="missing (planned, never started)"))
    keys = list(runs[0].grid)
    for run in runs:
        if sorted(run.grid) != sorted(keys):
            raise ValueError(f"run '{run.name}' has grid keys {sorted(run.grid)}, run '{runs[0].name}' "
                             f"{sorted(keys)}: one experiment folder must hold one sweep")
    return runs


def group_runs(runs: list[Run]) -> tuple[list[str], list[Group]]:
    """``(group keys, groups)``: the runs grouped by every grid key except ``seed``, in grid order.

    A seed another group has but this one lacks (no folder at all) is listed in its ``missing``."""
    keys = list(runs[0].grid)
    group_keys = [k for k in keys if k != SEED_KEY]
    seen = {k: sorted({run.grid[k] for run in runs}, key=_sort_key) for k in keys}
    by_key: dict[tuple, list[Run]] = {}
    for run in runs:
        by_key.setdefault(tuple(run.grid[k] for k in group_keys), []).append(run)
    names = {run.name for run in runs}
    groups = []
    for values in sorted(by_key, key=lambda v: [_sort_key(x) for x in v]):
        members = sorted(by_key[values], key=lambda r: [_sort_key(r.grid[k]) for k in keys])
        missing = []
        if SEED_KEY in keys:
            for seed in seen[SEED_KEY]:
                point = dict(members[0].grid, **{SEED_KEY: seed})
                name = ",".join(f"{k}={point[k]}" for k in keys)
                if name not in names:
                    missing.append(name)
        groups.append(Group(dict(zip(group_keys, values)), members, missing))
    return group_keys, groups


def format_cell(metric: ReportedMetric, summary: Optional[Summary], row_n: int) -> str:
    """``mean ± std`` (the std only for n > 1; ``(n=k)`` when fewer runs than the row have it)."""
    if summary is None:
        return "–"
    digits = 1 if metric.percent else 3
    text = f"{metric.shown(summary.mean):.{digits}f}"
    if summary.std is not None:
        text += f" ± {metric.shown(summary.std):.{digits}f}"
    if summary.n != row_n:
        text += f" (n={summary.n})"
    return text


def problems_of(group: Group) -> list[str]:
    """One line per run of ``group`` that is missing, failed, or lacks its probe or an evaluation."""
    lines = [f"{name}: missing (no run folder)" for name in group.missing]
    lines += [f"{run.name}: {run.problem}" for run in group.runs if run.problem]
    lines += [f"{run.name}: {problem}" for run in group.counted for problem in run.evaluation_problems.values()]
    return lines


def not_counted_cell(group: Group) -> str:
    """The row's runs that are not counted, short: ``seed=2 (failed)``."""
    def short(name: str) -> str:
        return ",".join(f"{k}={v}" for k, v in parse_run_name(name).items() if k not in group.key) or name

    cells = [f"{short(name)} (no folder)" for name in group.missing]
    cells += [f"{short(run.name)} ({run.problem.split(' ')[0]})" for run in group.runs if run.problem]
    cells += [f"{short(run.name)} ({name} {problem.split(' ')[1]})" for run in group.counted
              for name, problem in run.evaluation_problems.items()]
    return ", ".join(cells)


def with_variants(metrics: Sequence[ReportedMetric], runs: Sequence[Run]) -> list[ReportedMetric]:
    """``metrics`` with, after each, the variants the runs logged of it: ``knn/top1@k=10`` of a
    ``KNNEvaluator(k=[10, 20])`` or of a second kNN in the Trainer (:mod:`lightning_mods.evaluation.metric_names`),
    each its own column labelled with its setting."""
    columns: list[ReportedMetric] = []
    for metric in metrics:
        columns.append(metric)
        names = {name for run in runs for name in run.logged(metric.fit)}
        variants = sorted((n for n in names if metric_names.base_name(n) == metric.name and metric_names.variant_tag(n)),
                          key=lambda n: [_sort_key(part.partition("=")[2] or part)
                                         for part in metric_names.variant_tag(n).split(",")])
        head, _, unit = metric.label.partition(" (")
        for name in variants:
            label = f"{head} @{metric_names.variant_tag(name)}" + (f" ({unit}" if unit else "")
            columns.append(ReportedMetric(name, label, metric.percent, metric.fit))
    return columns


def evaluation_metrics(runs: Sequence[Run]) -> list[ReportedMetric]:
    """One column per named evaluation the runs have (``sweep --evaluate``): its ``val/top1``; the
    ``--then`` fit's is the offline probe's column, after the online probe's."""
    names = sorted({name for run in runs for name in (*run.evaluation_metrics, *run.evaluation_problems)}
                   - {OFFLINE_PROBE.fit})
    return [ReportedMetric("val/top1", f"{name} top-1 (%)", percent=True, fit=name) for name in names]


def table_metrics(runs: Sequence[Run]) -> list[ReportedMetric]:
    """The table's columns: kNN, then the evaluations of the runs' checkpoints, then the rest."""
    return with_variants((TABLE_METRICS[0], *evaluation_metrics(runs), *TABLE_METRICS[1:]), runs)


def present_metrics(groups: list[Group], metrics: Sequence[ReportedMetric]) -> list[ReportedMetric]:
    """The metrics at least one counted run logged."""
    return [m for m in metrics if any(g.summary(m) is not None for g in groups)]


def scatter_points(runs: list[Run]) -> tuple[Optional[ReportedMetric], list[tuple[Run, float, float]]]:
    """``(probe metric, [(run, effective rank, probe accuracy)])`` of Figure 5c: the offline probe
    where any run has one, else the online probe (else a classifier's own val top-1)."""
    for probe in (OFFLINE_PROBE, ONLINE_PROBE, SUPERVISED):
        points = [(run, run.final(EFFECTIVE_RANK.name), run.final(probe.name, probe.fit)) for run in runs]
        points = [(run, rank, acc) for run, rank, acc in points if rank is not None and acc is not None]
        if points:
            return probe, points
    return None, []


def markdown_table(experiment: str, group_keys: list[str], groups: list[Group],
                   metrics: list[ReportedMetric], correlation: dict, stale: list[str]) -> str:
    """The report as Markdown: the table, how its numbers were made, and the missing/failed runs."""
    with_problems = any(problems_of(group) for group in groups)
    header = [*(group_keys or ["runs"]), "n (seeds)", *(m.label for m in metrics)]
    header += ["not counted"] if with_problems else []
    lines = [f"# {experiment}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for group in groups:
        n = len(group.counted)
        cells = [*(group.key.values() if group_keys else ["all"]), str(n),
                 *(format_cell(m, group.summary(m), n) for m in metrics)]
        cells += [not_counted_cell(group)] if with_problems else []
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Each cell: mean ± sample standard deviation (ddof=1) over the n seeds of the row (no ± for "
              "one seed; `(n=k)` where only k of them logged the metric). A run's value is its final value: "
              "the last value of the metric logged in its `metrics.csv` (the offline probe's: the last "
              "`val/top1` in `<run>/probe/metrics.csv`; an evaluation's, in `<run>/<evaluation>/metrics.csv`). Accuracies in percent; effective rank "
              "`rank/effective_rank` (exp of the singular-value entropy)."]
    if correlation.get("n"):
        r = correlation["r"]
        lines += ["", f"Pearson r between {correlation['probe']} top-1 and effective rank over "
                  f"{correlation['n']} runs: " + ("undefined" if r is None else f"{r:.3f}") + "."]
    problems = [line for group in groups for line in problems_of(group)]
    lines += ["", "Missing or failed runs (not counted): " + ("none." if not problems else "")]
    lines += [f"- {line}" for line in problems]
    started = [f"- {run.name}/{name}: {shown_path(path, run.folder)}" for group in groups for run in group.counted
               for name, path in sorted(run.started_from.items())]
    if started:
        lines += ["", "The checkpoint each evaluation of a run started from (`model.checkpoint` in its `config.yaml`):"]
        lines += started
    unrecorded = [run.name for group in groups for run in group.counted if not run.recorded]
    if unrecorded:
        lines += ["", "Counted by their fit_end.json, without a sweep.json (made by `sweep --print` or outside "
                  "the sweep): " + ", ".join(unrecorded) + "."]
    if stale:
        lines += ["", "Counted, but from before the end of their run (the evaluation cadence missed the last "
                  "epoch; the run trained on after these values):"]
        lines += [f"- {line}" for line in stale]
    return "\n".join(lines) + "\n"


def shown_path(path: str, run_folder: Path) -> str:
    """``path`` relative to the run's folder when it lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(run_folder.resolve()))
    except ValueError:
        return path


def stale_values(groups: list[Group], metrics: Sequence[ReportedMetric]) -> list[str]:
    """One line per counted run and table metric whose final value was logged before the run's
    last epoch."""
    lines = []
    for run in (run for group in groups for run in group.counted):
        for metric in metrics:
            epoch = run.stale_epoch(metric.name, metric.fit)
            if epoch is not None and run.final(metric.name, metric.fit) is not None:
                where = "its" if metric.fit is None else f"its {metric.fit}'s"
                lines.append(f"{run.name}: {metric.label.split(' (')[0]} from epoch {epoch}; {where} last logged "
                             f"epoch is {run.last_epoch(metric.fit)}")
    return lines


def column_key(metric: ReportedMetric) -> str:
    """``val/top1``, ``probe/val/top1`` or ``<evaluation>/val/top1``: a metric's key in report.json."""
    return metric.name if metric.fit is None else f"{metric.fit}/{metric.name}"


def report_data(experiment: str, group_keys: list[str], groups: list[Group], correlation: dict,
                stale: list[str]) -> dict:
    """The raw numbers of the report (fractions for accuracies, as logged)."""
    runs = [run for group in groups for run in group.runs]
    metrics = table_metrics(runs) + with_variants(EXTRA_METRICS, runs)

    def stats(summary: Optional[Summary]) -> Optional[dict]:
        return None if summary is None else {"mean": summary.mean, "std": summary.std, "n": summary.n,
                                             "values": summary.values}

    return {
        "experiment": experiment,
        "group_keys": group_keys,
        "final_value": "the last value logged for the metric in the run's metrics.csv",
        "std": "sample standard deviation (ddof=1) over seeds; null for one seed",
        "groups": [{"group": group.key, "n": len(group.counted), "runs": [r.name for r in group.counted],
                    "metrics": {column_key(m): stats(group.summary(m)) for m in metrics},
                    "problems": problems_of(group)} for group in groups],
        "stale_values": stale,
        "runs": [{"name": run.name, "grid": run.grid, "counted": run.counted, "problem": run.problem,
                  "probe_problem": run.evaluation_problems.get(FOLLOW_UP_DIR),
                  "evaluation_problems": run.evaluation_problems,
                  "final": {column_key(m): run.final(m.name, m.fit) for m in [*metrics, OFFLINE_PROBE]}}
                 for group in groups for run in group.runs],
        "correlation": correlation,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shortcutlab report", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("experiment", help="the sweep's folder, runs/<experiment>")
    parser.add_argument("--out", default=None, help="where to write (default: <experiment>/report)")
    return parser


def make_report(experiment: Path, out: Path) -> dict:
    """Read the runs of ``experiment``, write ``report.md``, ``report.json`` and the figures to
    ``out``; returns ``{"markdown": text, "files": [paths], "data": report.json's content}``."""
    from rich.progress import track

    from commands._report_figures import metric_vs_group_figure, rank_over_epochs_figure, probe_vs_rank_figure

    folders = find_runs(experiment, skip=out)
    runs = list(track(folders, description=f"reading {len(folders)} runs", transient=True))
    group_keys, groups = group_runs(runs)
    counted = [run for group in groups for run in group.counted]
    probe, points = scatter_points(counted)
    r = pearson_r([p[1] for p in points], [p[2] for p in points]) if points else None
    correlation = {"probe": None if probe is None else {OFFLINE_PROBE: "offline probe", ONLINE_PROBE: "online probe",
                                                        SUPERVISED: "val"}[probe],
                   "r": r, "n": len(points)}
    columns = table_metrics(runs)
    metrics = present_metrics(groups, columns)
    stale = stale_values(groups, columns)
    markdown = markdown_table(experiment.name, group_keys, groups, metrics, correlation, stale)
    data = report_data(experiment.name, group_keys, groups, correlation, stale)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "report.md", out / "report.json"]
    write_text_atomically(files[0], markdown)
    write_text_atomically(files[1], json.dumps(data, indent=2) + "\n")
    if metrics and group_keys:
        files.append(metric_vs_group_figure(out, group_keys, groups, metrics))
    if any(run.history(EFFECTIVE_RANK.name) for run in counted):
        files.append(rank_over_epochs_figure(out, groups, EFFECTIVE_RANK))
    if points:
        files.append(probe_vs_rank_figure(out, groups, points, probe, r))
    return {"markdown": markdown, "files": files, "data": data}


def print_summary(result: dict, group_keys: list[str]) -> None:
    """The table and where the files went, on the terminal."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # a log file or a pipe: no need to wrap the table at 80 columns
        console = Console(width=200)
    markdown = result["markdown"]
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    table = Table(title=markdown.splitlines()[0].lstrip("# "))
    for name in header:
        table.add_column(name, justify="left" if name in group_keys else "right")
    for row in rows[2:]:
        table.add_row(*(c.strip() for c in row.strip("|").split("|")))
    console.print(table)
    for group in result["data"]["groups"]:
        for line in group["problems"]:
            console.print(f"[yellow]not counted:[/yellow] {line}", highlight=False)
    for line in result["data"]["stale_values"]:
        console.print(f"[yellow]from before the run's end:[/yellow] {line}", highlight=False)
    console.print(f"wrote {len(result['files'])} files to {result['files'][0].parent}:")
    for path in result["files"]:
        console.print(f"  {path}", soft_wrap=True, highlight=False)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """``shortcutlab report``: a bad folder ends with one line on stderr and exit status 2."""
    parsed = build_parser().parse_args(argv)
    experiment = Path(parsed.experiment)
    out = Path(parsed.out) if parsed.out else experiment / REPORT_DIR
    try:
        result = make_report(experiment, out)
    except (ValueError, FileNotFoundError) as err:
        print(f"shortcutlab report: error: {err}", file=sys.stderr)
        sys.exit(exit_statuses.BAD_INPUT)
    print_summary(result, result["data"]["group_keys"])
    return result


if __name__ == "__main__":
    main()
