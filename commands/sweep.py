"""Run a grid of ``shortcutlab fit`` runs: the rows of a paper table (docs/reproducing.md, "Reproduce a table").

    shortcutlab sweep --experiment quickstart_seeds --config configs/digits_mae.yaml \\
        --grid model.shortcut.alpha_min=0.6,0.8,1.0 --grid seed_everything=0,1,2 \\
        --then configs/linear_probe_digits.yaml
    shortcutlab report runs/quickstart_seeds

Every point of the grid (the product of the ``--grid`` axes) is one run in
``<runs-dir>/<experiment>/<name>/`` with a readable, stable name built from the grid values
(``alpha_min=0.6,seed=1``): ``run.yaml`` (the loggers' config fragment: the CSV logger the report
reads, then the loggers the configs chose, W&B runs grouped and MLflow runs filed under the
experiment, each named after its run; :mod:`commands._run_loggers`), the saved config,
``metrics.csv`` (and TensorBoard's events), checkpoints,
pictures and ``sweep.json`` (command, exit status, seconds). Runs go one after another; with
``--print`` the commands are printed instead, one line per run, for a cluster array job
(they neither skip finished runs nor resume: ``shortcutlab sweep`` itself does both).

``--set KEY=VALUE`` reaches every fit of the sweep (each run and its ``--then`` and ``--evaluate``
fits: a data folder, say); ``--run-set`` only the runs, ``--then-set`` only the ``--then`` fit,
and an ``--evaluate`` list's own ``KEY=VALUE`` items only that evaluation.

A run whose ``sweep.json`` says it finished is skipped; an interrupted one resumes from its
newest checkpoint that loads (bit for bit, docs/reliability.md; a truncated newer one is
skipped with one line). ``--evaluate NAME=CONFIG[,CONFIG...]`` (repeatable) fits configs after
each run with ``model.checkpoint`` set to the run's newest checkpoint, each logging to
``<run>/NAME``: fine-tuning and the linear-probe protocols of one pre-training side by side, one
report column each (the decay paper's Table 1). ``--then CONFIG`` (repeatable, to compose) is
the evaluation named ``probe`` (the offline linear probe, the report's "offline probe" column),
with ``--then-set`` as its settings; ``sweep.json`` records every evaluation the same way. A failed run is reported and the others still run; the sweep exits non-zero
when any run failed.

Before anything starts (or is printed), the first point's composed config and its ``--then`` and
``--evaluate`` fits are parsed in full, and every other value of every grid key is checked against
its setting's type on top of it: a typo in a key or a bad value is one line naming the first point
that has it, exit status 2, no run started. ``sweep.json``
keeps the settings each run was asked for (its ``fit`` arguments and a digest of each config
file): a run recorded with other settings (``--run-set trainer.max_epochs=6`` after a 4-epoch
sweep, an edited config) is neither skipped nor resumed; the sweep stops before anything starts,
in one line naming the difference, and the old run's folder is kept. The sweep
owns its runs: SIGTERM or SIGINT (Ctrl+C) is passed on to the run in progress, which saves its
resumable checkpoint; the sweep then exits with ``128 + signal`` and the same command resumes it.
A run dies with its sweep, even one killed by SIGKILL (it gets SIGTERM and saves first).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import signal
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

# the grid (commands._sweep_grid), the run folder (commands._run_folder) and the supervision of the
# runs' processes (commands._supervised_run) have modules of their own
from commands._run_folder import (CHECKPOINT_AT_RUN_TIME, FOLLOW_UP_DIR, newest_checkpoint_shell, record_plan,
                                 resumable_checkpoint, sweep_record, write_logging_fragment)
from commands._run_loggers import run_loggers
from commands._supervised_run import STOP_GRACE_SECONDS, Stopped, fit_resuming, shell_line
from commands._sweep_grid import Evaluation, as_options, grid_points, parse_axis, parse_evaluation, run_name
import lightning_mods.exit_statuses as exit_statuses
from lightning_mods.checkpointing.atomic_files import DiskWriteError, write_text_atomically


def fit_arguments(configs: Sequence[str], point: dict[str, str], extra: Sequence[str]) -> list[str]:
    """The ``shortcutlab fit`` arguments of one grid point, before the sweep's logging fragment;
    ``extra``: the settings of every fit (``--set``), then the runs' own (``--run-set``)."""
    args = ["fit", *(f"--config={c}" for c in configs)]
    args += [f"--{key}={value}" for key, value in point.items()]
    return args + as_options(extra)


def fit_command(configs: Sequence[str], point: dict[str, str], extra: Sequence[str], save_dir: Path,
                version: str, logger: Any) -> list[str]:
    """The ``shortcutlab fit`` arguments of one run (without the program); ``logger``: the
    ``trainer.logger`` its configs parse to (:func:`check_points`)."""
    return fit_arguments(configs, point, extra) + [f"--config={logging_fragment(save_dir, version, logger)}"]


def logging_fragment(save_dir: Path, version: str, logger: Any) -> Path:
    """The run's ``run.yaml``: its CSV logger, then the loggers its configs chose (``logger``), told
    the sweep (``save_dir``'s name) and the run (``version``)."""
    return write_logging_fragment(save_dir, version, run_loggers(logger, save_dir, version, save_dir.name))


def follow_up_arguments(configs: Sequence[str], checkpoint: Path, point: dict[str, str],
                        extra: Sequence[str]) -> list[str]:
    """``fit`` of the composed ``configs`` on the run's checkpoint (the offline probe), seeded like
    the run, with the settings ``extra`` (``--set``'s, then this fit's own), before the logging
    fragment."""
    args = ["fit", *(f"--config={c}" for c in configs), f"--model.checkpoint={checkpoint}"]
    if "seed_everything" in point:
        args.append(f"--seed_everything={point['seed_everything']}")
    return args + as_options(extra)


def follow_up_command(configs: Sequence[str], checkpoint: Path, point: dict[str, str], extra: Sequence[str],
                      save_dir: Path, version: str, folder: str, logger: Any) -> list[str]:
    """:func:`follow_up_arguments` logging to ``<run>/<folder>`` (``probe``, or an evaluation's name)."""
    return follow_up_arguments(configs, checkpoint, point, extra) + [
        f"--config={logging_fragment(save_dir, f'{version}/{folder}', logger)}"]


def check_points(parsed: argparse.Namespace, points: Sequence[dict[str, str]]) -> dict[str, Any]:
    """Check the grid as its runs would parse it, before any run starts or any line is printed: the
    first point's composed config (and its ``--then`` and ``--evaluate`` fits') in full, then every
    other value of every grid key against its setting's type, on top of that config (a bad key or
    value is a ValueError naming the first point that has it: one typo would otherwise fail every
    run of the grid, each after its start-up). Returns the ``trainer.logger`` each fit parses
    to: the runs' under ``""``, each evaluation's under its name."""
    from commands.lightning_cli import ArgumentChecker  # torch and Lightning: only when checking

    for key in points[0]:
        if key.split(".")[:2] == ["trainer", "logger"]:
            raise ValueError(f"--grid {key}: every run of a sweep logs to the same loggers; set them in a config "
                             "or with --set")
    check = ArgumentChecker()  # one parser for every check
    first = points[0]
    arguments = fit_arguments(parsed.config, first, run_settings(parsed))
    reason = check(arguments)
    if reason is not None:
        raise ValueError(f"grid point {run_name(first)}: {reason} (nothing was started)")
    loggers = {"": check.parsed("trainer")["logger"]}
    for key in first:
        for value in dict.fromkeys(point[key] for point in points[1:] if point[key] != first[key]):
            reason = check.check_setting(arguments, key, value)
            if reason is not None:
                where = run_name(next(point for point in points if point[key] == value))
                raise ValueError(f"grid point {where}: {reason} (nothing was started)")
    for evaluation in parsed.evaluations:  # the run's checkpoint does not exist yet: its path is only parsed
        reason = check(follow_up_arguments(evaluation.configs, Path("checkpoints/last.ckpt"), first,
                                           [*parsed.set, *evaluation.settings]))
        if reason is not None:
            raise ValueError(f"the {evaluation.option} fit of {run_name(first)}: {reason} (nothing was started)")
        loggers[evaluation.name] = check.parsed("trainer")["logger"]
    return loggers


def run_settings(parsed: argparse.Namespace) -> list[str]:
    """The settings of the grid's runs: ``--set`` (every fit) then ``--run-set`` (the runs only)."""
    return [*parsed.set, *parsed.run_set]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shortcutlab sweep", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:3]))
    parser.add_argument("--experiment", required=True, help="the sweep's name: runs go to <runs-dir>/<experiment>/")
    parser.add_argument("--config", action="append", required=True,
                        help="a config file; repeat to compose a base with fragments (later ones win)")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="one sweep axis (repeatable), e.g. model.shortcut.alpha_min=0.6,1.0 or seed_everything=0,1")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of every fit of the sweep (repeatable): each run and its --then and "
                             "--evaluate fits, e.g. data.init_args.data_dir=/data/imagenet")
    parser.add_argument("--run-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the grid's runs only (repeatable), not of their --then or --evaluate "
                             "fits, e.g. trainer.max_epochs=300")
    parser.add_argument("--then", action="append", default=[], metavar="CONFIG",
                        help="fit this config after each run on its last checkpoint (model.checkpoint), e.g. "
                             "configs/linear_probe_digits.yaml; repeat to compose; logged to <run>/probe")
    parser.add_argument("--then-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the --then fit only (repeatable), e.g. trainer.max_epochs=90")
    parser.add_argument("--evaluate", action="append", default=[], metavar="NAME=CONFIG[,CONFIG...]",
                        help="after each run, fit these composed configs from its checkpoint too (repeatable, "
                             "one report column each), logged to <run>/NAME; e.g. "
                             "ft=configs/finetune_digits.yaml; items with = are settings of that fit")
    parser.add_argument("--runs-dir", default="runs", help="where experiments live (default: runs)")
    parser.add_argument("--print", dest="print_only", action="store_true",
                        help="print one command line per run (for a cluster array job: line i is run i; with "
                             "--then, the fit && the probe) instead of running them")
    parser.add_argument("--stop-grace", type=float, default=STOP_GRACE_SECONDS, metavar="SECONDS",
                        help="after SIGTERM/SIGINT, how long the run in progress may take to save its resumable "
                             f"checkpoint and exit before it is killed (default {STOP_GRACE_SECONDS:g})")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    """Run (or print) the sweep; returns one record per run (name, status, seconds, command).

    Exit status: 2 for a bad argument or a point whose config does not parse (one line on stderr,
    nothing started); 1 when a run failed; ``128 + signal`` (143, 130) when SIGTERM or SIGINT
    stopped the sweep: the run in progress got the signal, saved its resumable checkpoint and
    ended, its ``sweep.json`` says so, and the same command resumes the sweep.
    """
    parsed = build_parser().parse_args(argv)
    try:
        return run_sweep(parsed)
    except (ValueError, FileNotFoundError) as err:
        print(f"shortcutlab sweep: error: {err}", file=sys.stderr)
        sys.exit(exit_statuses.BAD_INPUT)
    except DiskWriteError as err:  # its own record or plan: a full disk, a quota, a read-only folder
        print(f"shortcutlab sweep: error: {err}", file=sys.stderr)
        sys.exit(exit_statuses.DISK_ERROR)
    except Stopped as stop:
        print(f"shortcutlab sweep: stopped by {stop} (the run in progress ended with status {stop.status}); "
              "the same command resumes the sweep", file=sys.stderr, flush=True)
        sys.exit(exit_statuses.stopped_by(stop.signum))
    except KeyboardInterrupt:  # Ctrl+C outside a run (while checking the configs, say)
        print("shortcutlab sweep: stopped by SIGINT; no run was in progress", file=sys.stderr, flush=True)
        sys.exit(exit_statuses.stopped_by(signal.SIGINT))


def run_sweep(parsed: argparse.Namespace) -> list[dict]:
    """The sweep of the parsed arguments (see :func:`main`)."""
    parsed.evaluations = checked_evaluations(parsed)
    points = grid_points([parse_axis(axis) for axis in parsed.grid])
    loggers = check_points(parsed, points)
    save_dir = Path(parsed.runs_dir) / parsed.experiment
    if not parsed.print_only:
        check_recorded_settings(parsed, points, save_dir)
    record_plan(save_dir, [run_name(point) for point in points])
    records = []
    for index, point in enumerate(points, start=1):
        name = run_name(point)
        run = save_dir / name
        args = fit_command(parsed.config, point, run_settings(parsed), save_dir, name, loggers[""])
        if parsed.print_only:
            print(printed_line(parsed, args, run, point, save_dir, name, loggers))
            continue
        record_file = run / "sweep.json"
        record = sweep_record(json.loads(record_file.read_text())) if record_file.is_file() else {}
        print(f"[{index}/{len(points)}] {parsed.experiment}/{name}", flush=True)
        if record.get("status") != 0:
            try:
                run_args, status, seconds = fit_resuming(args, run, parsed.stop_grace)
            except Stopped as stop:
                record = {"name": name, "grid": point, "status": stop.status, "stopped_by": str(stop),
                          **requested_settings(parsed, point)}
                run.mkdir(parents=True, exist_ok=True)
                write_text_atomically(record_file, json.dumps(record, indent=2) + "\n")
                raise
            record = {"name": name, "grid": point, "command": shell_line(run_args), "status": status,
                      "seconds": round(seconds, 1), **requested_settings(parsed, point)}
            run.mkdir(parents=True, exist_ok=True)
            write_text_atomically(record_file, json.dumps(record, indent=2) + "\n")
        else:
            print(f"    done before ({record.get('seconds')} s), skipped", flush=True)
        if parsed.evaluations and record.get("status") == 0:
            run_evaluations(parsed, run, point, save_dir, name, record, record_file, loggers)
        records.append(record)
    if parsed.print_only:
        return []
    failed = [r["name"] for r in records if r.get("status") != 0
              or any(r.get("evaluations", {}).get(e.name, {}).get("status") != 0 for e in parsed.evaluations)]
    print(f"sweep {parsed.experiment}: {len(records) - len(failed)} of {len(records)} runs finished"
          + (f"; failed: {', '.join(failed)} (see their sweep.log)" if failed else "")
          + f"; report: shortcutlab report {save_dir}", flush=True)
    if failed:
        raise SystemExit(exit_statuses.SWEEP_RUN_FAILED)
    return records


def requested_settings(parsed: argparse.Namespace, point: dict[str, str]) -> dict:
    """What a run is asked for, as its ``sweep.json`` keeps it: its ``fit`` arguments (the sweep's
    logging fragment aside) and a digest of each config file they name."""
    return {"arguments": fit_arguments(parsed.config, point, run_settings(parsed)),
            "configs": {config: file_digest(config) for config in parsed.config}}


def file_digest(path: str) -> Optional[str]:
    """The SHA-256 of a file's bytes (None when there is no such file: the config check says so)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def settings_difference(record: dict, requested: dict) -> Optional[str]:
    """How a run's recorded settings differ from the requested ones, in words (None: the same, or
    a record written before the sweep kept them)."""
    recorded = record.get("arguments")
    if not isinstance(recorded, list):
        return None
    parts = []
    then = [a for a in recorded if a not in requested["arguments"]]
    now = [a for a in requested["arguments"] if a not in recorded]
    if then or now:
        parts.append(f"{' '.join(then) or 'nothing'} then, {' '.join(now) or 'nothing'} now")
    elif recorded != requested["arguments"]:
        parts.append("the same settings in another order")
    for config, digest in requested["configs"].items():
        old = (record.get("configs") or {}).get(config)
        if old is not None and old != digest:
            parts.append(f"{config} has changed since")
    return "; ".join(parts) or None


def check_recorded_settings(parsed: argparse.Namespace, points: Sequence[dict[str, str]], save_dir: Path) -> None:
    """A ValueError naming the difference when a run of the grid was run (or started) with other
    settings: its results are kept, never resumed, skipped or reported as the new settings'."""
    for point in points:
        run = save_dir / run_name(point)
        if not (run / "sweep.json").is_file():
            continue
        recorded = json.loads((run / "sweep.json").read_text())
        difference = settings_difference(recorded, requested_settings(parsed, point))
        if difference:
            raise ValueError(f"{run} was run with other settings ({difference}); its results are kept: sweep into "
                             "another --experiment, or move that folder away to rerun it (nothing was started)")


def checked_evaluations(parsed: argparse.Namespace) -> list[Evaluation]:
    """The sweep's ``--then`` and ``--evaluate`` fits, once its files and options are checked
    (``FileNotFoundError`` or ``ValueError``, one line)."""
    for config in parsed.config + parsed.then:
        if not Path(config).is_file():
            raise FileNotFoundError(f"--config: no file '{config}'")
    for option, settings in (("--set", parsed.set), ("--run-set", parsed.run_set), ("--then-set", parsed.then_set)):
        for setting in settings:
            if "=" not in setting:
                raise ValueError(f"{option}: expected KEY=VALUE, got {setting!r}")
    if parsed.then_set and not parsed.then:
        raise ValueError("--then-set: needs --then CONFIG (the fit it sets)")
    if parsed.stop_grace <= 0:
        raise ValueError(f"--stop-grace: must be > 0 seconds, got {parsed.stop_grace:g}")
    # --then is the evaluation named "probe" (its folder): one record shape, one report branch
    evaluations = ([Evaluation(FOLLOW_UP_DIR, tuple(parsed.then), tuple(parsed.then_set))] if parsed.then
                   else []) + [parse_evaluation(text) for text in parsed.evaluate]
    repeated = sorted({e.name for e in evaluations if [f.name for f in evaluations].count(e.name) > 1})
    if repeated:
        raise ValueError(f"--evaluate: {', '.join(repeated)} named more than once")
    return evaluations


def printed_line(parsed: argparse.Namespace, args: list[str], run: Path, point: dict[str, str], save_dir: Path,
                 name: str, loggers: dict[str, Any]) -> str:
    """The shell line of one run for ``--print``: its fit, then ``&&`` each evaluation, whose
    checkpoint the shell picks when the line runs."""
    line = shell_line(args)
    for evaluation in parsed.evaluations:
        follow = shell_line(follow_up_command(evaluation.configs, Path(CHECKPOINT_AT_RUN_TIME), point,
                                              [*parsed.set, *evaluation.settings], save_dir, name, evaluation.name,
                                              loggers[evaluation.name]))
        line += " && " + follow.replace(CHECKPOINT_AT_RUN_TIME, newest_checkpoint_shell(run))
    return line


def run_evaluations(parsed: argparse.Namespace, run: Path, point: dict[str, str], save_dir: Path, name: str,
                    record: dict, record_file: Path, loggers: dict[str, Any]) -> None:
    """Each ``--then`` and ``--evaluate`` fit of ``run`` not yet finished, from its checkpoint, resumed where one
    stopped; its command, exit status and seconds go into ``record["evaluations"][NAME]``."""
    done = record.setdefault("evaluations", {})
    for evaluation in parsed.evaluations:
        if done.get(evaluation.name, {}).get("status") == 0:
            continue
        checkpoint = resumable_checkpoint(run)
        if checkpoint is None:
            done[evaluation.name] = {"status": 1}
            print(f"    {evaluation.option}: {run} has no checkpoints/last.ckpt", file=sys.stderr)
        else:
            follow = follow_up_command(evaluation.configs, checkpoint, point, [*parsed.set, *evaluation.settings],
                                       save_dir, name, evaluation.name, loggers[evaluation.name])
            print(f"    {evaluation.option}", flush=True)
            try:
                follow, status, seconds = fit_resuming(follow, run / evaluation.name, parsed.stop_grace)
            except Stopped as stop:
                done[evaluation.name] = {"status": stop.status, "stopped_by": str(stop)}
                write_text_atomically(record_file, json.dumps(record, indent=2) + "\n")
                raise
            done[evaluation.name] = {"command": shell_line(follow), "status": status, "seconds": round(seconds, 1)}
        write_text_atomically(record_file, json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
