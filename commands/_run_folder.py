"""A sweep's run folder: where a run logs (``run.yaml``), the experiment's plan of runs, the
checkpoint a run resumes from or is evaluated from, and its metrics kept across a resume."""
from __future__ import annotations

import csv
import io
import json
import shlex
from pathlib import Path
from typing import Optional, Sequence

from lightning_mods.checkpointing.atomic_files import write_text_atomically

FOLLOW_UP_DIR = "probe"  # the --then fit's folder, and its evaluation name in sweep.json
PLAN_FILE = "sweep_plan.json"  # every run asked for in <runs-dir>/<experiment>: the report names those not started


def write_logging_fragment(save_dir: Path, version: str, loggers: list[dict]) -> Path:
    """``<save_dir>/<version>/run.yaml``: a config fragment that gives the run ``loggers``
    (:func:`commands._run_loggers.run_loggers`: the CSV logger ``shortcutlab report`` reads, in
    the run's fixed folder ``save_dir/version`` instead of ``lightning_logs/version_N``, then the
    loggers its configs chose) and the callback that records a normal end of the fit there
    (``fit_end.json``, :mod:`callbacks.reliability.fit_end_record`)."""
    trainer = {"logger": loggers, "callbacks+": [{"class_path": "callbacks.reliability.fit_end_record.FitEndRecord"}]}
    path = save_dir / version / "run.yaml"
    write_text_atomically(path, "# written by shortcutlab sweep: where this run logs\n"
                          + json.dumps({"trainer": trainer}, indent=2, default=str) + "\n")
    return path


def read_plan(save_dir: Path) -> list[str]:
    """The run names of ``<save_dir>/sweep_plan.json`` (none without one)."""
    path = save_dir / PLAN_FILE
    try:
        return [str(name) for name in json.loads(path.read_text())["runs"]] if path.is_file() else []
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{path}: not a sweep plan (expected {{\"runs\": [names]}}); move it away to start "
                         "a new plan") from None


def record_plan(save_dir: Path, names: Sequence[str]) -> None:
    """Add ``names`` to ``<save_dir>/sweep_plan.json``, the runs this experiment was asked for
    (by every sweep into it, printed ones included), so that a report can name the runs that
    never started, even a whole row of them."""
    planned = read_plan(save_dir)
    planned += [name for name in names if name not in planned]
    save_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(save_dir / PLAN_FILE, json.dumps({"runs": planned}, indent=2) + "\n")


CHECKPOINT_AT_RUN_TIME = "@newest-checkpoint@"  # placeholder in a printed --then line


def newest_checkpoint_shell(run: Path) -> str:
    """A shell word that is :func:`last_checkpoint` of ``run`` when the printed line runs (the
    newer of the two files by modification time; ``ls -t`` puts ``last.ckpt`` first on a tie)."""
    files = " ".join(shlex.quote(str(run / "checkpoints" / name)) for name in ("last.ckpt", "latest.ckpt"))
    return f'"$(ls -t {files} 2>/dev/null | head -n 1)"'


def last_checkpoint(run: Path) -> Optional[Path]:
    """The newer of the run's ``checkpoints/last.ckpt`` and ``checkpoints/latest.ckpt`` (None
    when it has neither): the resume point and the network ``--then`` probes.

    Either can be the stale one: ``save_last`` is refreshed only on its callback's cadence (every
    20 epochs in the MAE configs, so not at a last epoch off that cadence), and a pre-emption
    writes ``last.ckpt`` in configs that otherwise keep only the every-epoch ``latest.ckpt``.
    """
    found = [path for path in (run / "checkpoints" / "last.ckpt", run / "checkpoints" / "latest.ckpt")
             if path.is_file()]
    return max(found, key=lambda path: path.stat().st_mtime_ns) if found else None  # a tie keeps last.ckpt


def resumable_checkpoint(run: Path) -> Optional[Path]:
    """The newest checkpoint of ``run`` (``checkpoints/*.ckpt`` by modification time, ``last.ckpt``
    and ``latest.ckpt`` first on a tie) that loads; each newer one that does not (a save cut
    short by a full disk or a killed node, before checkpoints were written atomically) is
    skipped with one line saying why."""
    from lightning_mods.checkpointing.rebuild import newest_loadable  # torch: only when a run resumes

    folder = run / "checkpoints"
    if not folder.is_dir():
        return None
    return newest_loadable(list(folder.glob("*.ckpt")), lambda line: print(f"    {line}", flush=True))


def merge_metrics_csv(earlier: str, path: Path) -> None:
    """Put the rows of ``earlier`` (the ``metrics.csv`` text before a resume) back in front of the
    resumed attempt's ``path``: Lightning's CSVLogger deletes an existing ``metrics.csv`` when it
    starts, which would lose the evaluations logged before the checkpoint. Earlier rows from the
    first step the resumed attempt logged on are dropped (the interrupted attempt logged them
    after its checkpoint, and they are logged again)."""
    old_rows = list(csv.DictReader(io.StringIO(earlier)))
    new_rows = list(csv.DictReader(io.StringIO(path.read_text()))) if path.is_file() else []

    def step(row: dict) -> float:
        return float(row["step"]) if row.get("step") not in (None, "") else float("-inf")

    first_new = min((step(row) for row in new_rows), default=float("inf"))
    rows = [row for row in old_rows if step(row) < first_new] + new_rows
    columns = sorted({key for row in rows for key in row if key is not None})
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows({key: value for key, value in row.items() if key is not None} for row in rows)
    write_text_atomically(path, text.getvalue())


def sweep_record(record: dict) -> dict:
    """A run's ``sweep.json`` record with its fits from the checkpoint under ``evaluations``: a
    record written before ``--then`` was kept there (``probe_status``, ``probe_command``,
    ``probe_seconds``, ``probe_stopped_by``) gets them as the evaluation ``probe``."""
    legacy = {key.removeprefix("probe_"): record.pop(key) for key in
              ("probe_status", "probe_command", "probe_seconds", "probe_stopped_by") if key in record}
    if legacy:
        evaluations = record.get("evaluations") if isinstance(record.get("evaluations"), dict) else {}
        evaluations.setdefault(FOLLOW_UP_DIR, legacy)
        record["evaluations"] = evaluations
    return record
