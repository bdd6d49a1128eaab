"""A requeued SLURM job resumes exactly (issue 24, single task): the README's sbatch script run
with the environment ``srun`` gives a task and a stand-in ``scontrol`` that records its calls.
SIGUSR1 stops the fit after the step in progress, writes the exact ``last.ckpt``, requeues the job
once with the right id and exits 138; the same command as the requeued job (``SLURM_RESTART_COUNT=1``)
resumes by itself and ends with the uninterrupted run's weights, optimiser state and step."""
from __future__ import annotations

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

from callbacks.preemption import requeue_slurm_job, slurm_job_id
from commands.lightning_cli import resolve_auto_ckpt_path
from test_resume import assert_identical

ROOT = Path(__file__).resolve().parents[1]
STOP_STEP = 3
BUDGET = ["--trainer.max_epochs=2", "--trainer.limit_train_batches=4", "--trainer.limit_val_batches=1",
          "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu", "--model.depth=2",
          "--model.decoder_depth=1", "--model.embed_dim=32", "--model.num_heads=2"]


def readme_script() -> list[str]:
    """The lines of the README's SLURM job script (Reliability, "SLURM")."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("- **SLURM.**"):]
    block = section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 7)]
    return [line.strip() for line in block.strip().splitlines()]


def srun_command(root: Path) -> list[str]:
    (line,) = [line for line in readme_script() if line.startswith("srun ")]
    words = shlex.split(line)[1:]
    assert words[0] == ".venv/bin/shortcutlab"
    words = [w if not w.startswith("--trainer.default_root_dir=") else f"--trainer.default_root_dir={root}"
             for w in words[1:]]
    return [sys.executable, "-m", "cli", *words, *BUDGET]


def slurm_environment(tmp_path: Path, restart: int = 0, **extra: str) -> dict[str, str]:
    """One task's ``srun`` environment, and ``scontrol`` on PATH writing its arguments to a file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.calls'}\n")
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="train", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
               SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NNODES="1",
               SLURM_NODELIST="localhost", SLURM_RESTART_COUNT=str(restart), **extra)
    for key in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        if key not in extra:
            env.pop(key, None)
    return env


def last_state(root: Path) -> dict:
    """The newest checkpoint under ``root``."""
    ckpt = torch.load(max(root.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns), weights_only=True)
    return {"weights": ckpt["state_dict"], "optimizer": ckpt["optimizer_states"], "step": ckpt["global_step"]}


@pytest.mark.slow
def test_sigusr1_requeues_and_the_requeued_job_equals_the_uninterrupted_run(tmp_path):
    script = readme_script()
    for directive in ("#SBATCH --signal=SIGUSR1@90", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert directive in script
    # uninterrupted
    (tmp_path / "p").mkdir()
    plain = subprocess.run(srun_command(tmp_path / "plain"), cwd=ROOT, env=slurm_environment(tmp_path / "p"),
                           capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    # pre-empted at step 3 by SIGUSR1
    run = tmp_path / "requeued"
    ready = tmp_path / "ready"
    env = slurm_environment(tmp_path)
    first = subprocess.Popen([*srun_command(run), "--trainer.callbacks+=signal_helpers.WaitForSignal",
                              f"--trainer.callbacks.step={STOP_STEP}", f"--trainer.callbacks.ready_file={ready}"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first.send_signal(signal.SIGUSR1)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 128 + signal.SIGUSR1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("shortcutlab:")]
    assert len(lines) == 1, err[-3000:]
    assert re.fullmatch(rf"shortcutlab: stopped by SIGUSR1 at step {STOP_STEP}; resumable checkpoint \S+last\.ckpt "
                        r"\(resume: fit \.\.\. --ckpt_path \S+\); requeued SLURM job 4242 \(scontrol requeue 4242\); "
                        r"it resumes from the newest checkpoint", lines[0]), lines[0]
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"  # once, with the job's id
    assert not list(run.rglob("hpc_ckpt*"))  # Lightning's mid-step save is off
    # the requeued job: the same command, SLURM_RESTART_COUNT=1, no --ckpt_path
    second = subprocess.run(srun_command(run), cwd=ROOT, env=slurm_environment(tmp_path, restart=1),
                            capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    said = [line for line in second.stderr.splitlines() if line.startswith("shortcutlab:")]
    assert len(said) == 1 and re.fullmatch(rf"shortcutlab: SLURM restart 1 of job 4242: resuming from \S+last\.ckpt "
                                           rf"\(step {STOP_STEP}\)", said[0]), said
    assert (tmp_path / "scontrol.calls").read_text() == "requeue 4242\n"  # not again
    resumed, uninterrupted = last_state(run), last_state(tmp_path / "plain")
    assert resumed["step"] == uninterrupted["step"] == 8
    assert_identical(resumed, uninterrupted, "final state")
    # the requeued job replaced last.ckpt (the pre-emption save is the checkpoint callback's last)
    assert sorted(p.name for p in run.rglob("last*.ckpt")) == ["last.ckpt"]


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
