"""A requeued SLURM job resumes exactly: docs/reliability.md's sbatch script run with the
environment ``srun`` gives each task and a stand-in ``scontrol`` that records its calls, with one
task and with the script's two tasks (DDP over gloo). SIGUSR1 stops every task after the same step (whether it reached every task or
one), inside a training step, a validation or a checkpoint save; the exact ``last.ckpt`` is
written, the job is requeued once with the right id and every task exits 138; the same command as
the requeued job (``SLURM_RESTART_COUNT=1``) resumes by itself and ends with the uninterrupted
run's weights, optimiser state, logged metrics and step. Each task is a warm fork of the CLI
(tests/helpers/fork_server.py), which passes the signals on as the task's own process would get them.
(One process without SLURM: tests/callbacks/test_preemption.py.)"""
from __future__ import annotations

from helpers import folders

import csv
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from callbacks.reliability.preemption import requeue_slurm_job, slurm_job_id
from commands.lightning_cli import resolve_auto_ckpt_path
from test_callbacks_ddp import free_port
from test_exact_resume import assert_identical

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8  # 2 epochs of 4 batches
BUDGET = ["--trainer.max_epochs=2", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=2",
          "--trainer.check_val_every_n_epoch=1", "--trainer.log_every_n_steps=1",
          "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu", "--model.network.depth=2",
          "--model.network.decoder_depth=1", "--model.network.embed_dim=32", "--model.network.num_heads=2",
          "--trainer.logger=lightning.pytorch.loggers.CSVLogger"]
STOPPED = re.compile(r"shortcutlab: stopped by SIGUSR1 at step (\d+); resumable checkpoint (\S+last\.ckpt) "
                     r"\(resume: fit \.\.\. --ckpt_path \S+\); requeued SLURM job 4242 \(scontrol requeue 4242\); "
                     r"it resumes from the newest checkpoint")


def readme_script() -> list[str]:
    """The lines of docs/reliability.md's SLURM job script ("SLURM")."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text[text.index("- **SLURM.**"):]
    block = section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 7)]
    return [line.strip() for line in block.strip().splitlines()]


def script_tasks() -> int:
    """Tasks per node the script asks for (one node)."""
    (line,) = [line for line in readme_script() if "--ntasks-per-node=" in line]
    assert "--nodes=1" in line
    return int(re.search(r"--ntasks-per-node=(\d+)", line).group(1))


def srun_command(root: Path, env: dict[str, str], shortcutlab: list[str]) -> list[str]:
    """The script's ``srun`` line as one task runs it (its ``$SLURM_*`` words expanded from ``env``),
    ``.venv/bin/shortcutlab`` as ``shortcutlab`` (the warm CLI's command)."""
    (line,) = [line for line in readme_script() if line.startswith("srun ")]
    words = [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], w) for w in shlex.split(line)[1:]]
    assert words[0] == ".venv/bin/shortcutlab"
    words = [w if not w.startswith("--trainer.default_root_dir=") else f"--trainer.default_root_dir={root}"
             for w in words[1:]]
    return [*shortcutlab, *words, *BUDGET, f"--trainer.logger.init_args.save_dir={root}"]


def slurm_environment(tmp_path: Path, restart: int = 0, tasks: int = 1, task: int = 0, port: int = 0,
                      **extra: str) -> dict[str, str]:
    """Task ``task``'s ``srun`` environment, and ``scontrol`` on PATH writing its arguments to a file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    scontrol = bin_dir / "scontrol"
    # as SLURM, a requeue ends the job's tasks with SIGTERM (their pids: written by srun())
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.calls'}\n"
                        f"[ -f {tmp_path / 'tasks.pids'} ] && kill -TERM $(cat {tmp_path / 'tasks.pids'})\nexit 0\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=folders.PYTHONPATH, OMP_NUM_THREADS="1",
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="train", SLURM_NTASKS=str(tasks),
               SLURM_NTASKS_PER_NODE=str(tasks), SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NODEID="0",
               SLURM_NNODES="1", SLURM_NODELIST="localhost", SLURM_RESTART_COUNT=str(restart),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()), **extra)
    for key in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        if key not in extra:
            env.pop(key, None)
    return env


def srun(shortcutlab: list[str], root: Path, tmp_path: Path, tasks: int, restart: int = 0,
         extra: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    """Start the job step: one process per task, as ``srun`` would."""
    port = free_port()
    procs = []
    for task in range(tasks):
        env = slurm_environment(tmp_path, restart, tasks, task, port)
        procs.append(subprocess.Popen([*srun_command(root, env, shortcutlab), *extra], cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    (tmp_path / "tasks.pids").write_text(" ".join(str(proc.pid) for proc in procs))
    return procs


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    errs = [proc.communicate(timeout=600)[1] for proc in procs]
    return [(proc.returncode, err) for proc, err in zip(procs, errs)]


def final_state(root: Path) -> dict:
    """The run's newest checkpoint and its logged metrics (the rows of every ``metrics.csv``, the
    first job's ``version_0`` then the requeued job's ``version_1``)."""
    last = max(root.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime_ns)
    ckpt = torch.load(last, weights_only=True)
    rows = []
    for metrics in sorted(root.rglob("metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with metrics.open() as f:
            rows += [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    return {"weights": ckpt["state_dict"], "optimizer": ckpt["optimizer_states"], "step": ckpt["global_step"],
            "metrics": rows}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, warm_shortcutlab: list[str]):
    """The run never stopped, by number of tasks (each run once per module)."""
    runs: dict[int, dict] = {}

    def run(tasks: int) -> dict:
        if tasks not in runs:
            base = tmp_path_factory.mktemp(f"uninterrupted{tasks}")
            for status, err in finish(srun(warm_shortcutlab, base / "run", base, tasks)):
                assert status == 0, err[-3000:]
            runs[tasks] = final_state(base / "run")
            assert runs[tasks]["step"] == STEPS
        return runs[tasks]

    return run


def stop_requeue_and_resume(shortcutlab: list[str], tmp_path: Path, tasks: int, at: str, step: int,
                            signalled: list[int]) -> tuple[dict, int]:
    """SIGUSR1 to the tasks ``signalled`` while they wait at ``at`` of step ``step``; then the
    requeued job. Returns the requeued job's final state and the step the first job stopped at."""
    run = tmp_path / "requeued"
    ready = tmp_path / "ready"
    procs = srun(shortcutlab, run, tmp_path, tasks, extra=("--trainer.callbacks+=helpers.signal_helpers.WaitForSignal",
                                              f"--trainer.callbacks.step={step}", f"--trainer.callbacks.at={at}",
                                              f"--trainer.callbacks.ready_file={ready}",
                                              f"--trainer.callbacks.ranks={signalled}"))
    readies = [ready] if tasks == 1 else [Path(f"{ready}.rank{r}") for r in signalled]
    deadline = time.monotonic() + 300
    while not all(r.exists() for r in readies):
        for proc in procs:
            assert proc.poll() is None, "\n".join(err[-3000:] for _, err in finish(procs))
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for task in signalled:
        procs[task].send_signal(signal.SIGUSR1)
    done = finish(procs)
    for status, err in done:  # every task stops, with the same status, SLURM's SIGTERM after the requeue ignored
        assert status == 128 + signal.SIGUSR1, err[-3000:]
    said = [line for _, err in done for line in err.splitlines() if line.startswith("shortcutlab:")]
    if at == "validation" and 0 in signalled:  # said when the signal came, by the first task
        assert said.pop(0) == "shortcutlab: SIGUSR1 during validation: stopping when it ends"
    assert len(said) == 1, said  # one line for the job, from its first task
    stopped = STOPPED.fullmatch(said[0])
    assert stopped, said[0]
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"  # once, with the job's id
    assert not list(run.rglob("hpc_ckpt*"))  # Lightning's mid-step save is off
    # the requeued job: the same command, SLURM_RESTART_COUNT=1, no --ckpt_path
    done = finish(srun(shortcutlab, run, tmp_path, tasks, restart=1))
    for status, err in done:
        assert status == 0, err[-3000:]
    said = [line for _, err in done for line in err.splitlines() if line.startswith("shortcutlab:")]
    assert len(said) == 1 and re.fullmatch(rf"shortcutlab: SLURM restart 1 of job 4242: resuming from "
                                           rf"{re.escape(stopped.group(2))} \(step {stopped.group(1)}\)", said[0]), said
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"  # not again
    assert not list(run.rglob("last-v*.ckpt"))
    return final_state(run), int(stopped.group(1))


@pytest.mark.slow
def test_the_readme_script_asks_for_the_signal_requeue_and_appended_logs():
    script = readme_script()
    for directive in ("#SBATCH --signal=SIGUSR1@90", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert directive in script
    assert script_tasks() == 2


@pytest.mark.slow
@pytest.mark.parametrize("at, step, stop_step", [
    ("save", 4, 4),  # the epoch-end save finishes whole, then the fit stops at that boundary
    # a signal inside a training step: test_two_tasks (and, one process without SLURM,
    # tests/callbacks/test_preemption.py); in a validation: test_two_tasks
])
def test_one_task(tmp_path, uninterrupted, warm_shortcutlab, at, step, stop_step):
    resumed, stopped_at = stop_requeue_and_resume(warm_shortcutlab, tmp_path, 1, at, step, [0])
    assert stopped_at == stop_step
    assert_identical(resumed, uninterrupted(1), "requeued run")


@pytest.mark.slow
@pytest.mark.parametrize("at, step, signalled, stop_step", [
    # the signal comes after step k's stop decision (the helper waits in a later hook): stop after k + 1
    ("train_step", 2, [0, 1], 3),  # SLURM's --signal reaches every task
    ("train_step", 1, [1], 2),     # a signal to one task only stops every task after the same step
    ("validation", 4, [1], 4),     # the validation finishes, every task stops at the epoch's end
])
def test_two_tasks(tmp_path, uninterrupted, warm_shortcutlab, at, step, signalled, stop_step):
    resumed, stopped_at = stop_requeue_and_resume(warm_shortcutlab, tmp_path, script_tasks(), at, step, signalled)
    assert stopped_at == stop_step
    assert_identical(resumed, uninterrupted(script_tasks()), "requeued run")


def test_an_array_task_is_requeued_as_job_underscore_task(tmp_path, monkeypatch):
    env = slurm_environment(tmp_path, SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="3")
    for key in ("PATH", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.setenv(key, env[key])
    assert slurm_job_id() == "77_3"
    assert requeue_slurm_job() == ("requeued SLURM job 77_3 (scontrol requeue 77_3); it resumes from the newest "
                                   "checkpoint")
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 77_3\n"


def test_outside_slurm_nothing_is_requeued(monkeypatch):
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(key, raising=False)
    assert requeue_slurm_job() == "not a SLURM job (no SLURM_JOB_ID): nothing requeued"


def test_ckpt_path_auto_starts_fresh_without_a_checkpoint_and_skips_a_broken_one(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    cfg = {"ckpt_path": "auto", "trainer": {"default_root_dir": str(tmp_path)}}
    resolve_auto_ckpt_path(cfg)
    assert cfg["ckpt_path"] is None
    assert capsys.readouterr().err == f"shortcutlab: --ckpt_path auto: no checkpoint under {tmp_path}; starting fresh\n"
    good = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    good.parent.mkdir(parents=True)
    torch.save({"state_dict": {}, "global_step": 7}, good)
    broken = tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(good.read_bytes()[:50])
    os.utime(good, ns=(1_000_000_000, 1_000_000_000))
    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(good.read_bytes())  # Lightning's mid-step file: never chosen
    cfg = {"ckpt_path": "auto", "trainer": {"default_root_dir": str(tmp_path)}}
    resolve_auto_ckpt_path(cfg)
    assert cfg["ckpt_path"] == str(good)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"shortcutlab: skipped {broken}: not a loadable torch checkpoint")
    assert err[1] == f"shortcutlab: --ckpt_path auto: resuming from {good} (step 7)"
    # a first SLURM start (no restart count) is left alone
    cfg = {"ckpt_path": None, "trainer": {"default_root_dir": str(tmp_path)}}
    resolve_auto_ckpt_path(cfg)
    assert cfg["ckpt_path"] is None
