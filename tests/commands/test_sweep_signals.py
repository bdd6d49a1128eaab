"""The sweep owns its runs: SIGTERM (SIGINT takes the same path) or SIGKILL to the sweep
alone leaves no process behind (checked in the process table), the run saves its resumable
checkpoint, and rerunning the same command finishes every run; a typo in a grid key is refused
before anything starts."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commands import sweep

ROOT = Path(__file__).resolve().parents[2]
# a tiny quickstart whose epochs take a moment, so a signal lands mid-run (last.ckpt every epoch)
SLOW_ENOUGH = ["--config", str(ROOT / "configs" / "digits_mae.yaml"),
               "--set", "trainer.max_epochs=12", "--set", "trainer.limit_val_batches=1",
               "--set", "trainer.enable_progress_bar=false", "--set", "trainer.accelerator=cpu",
               "--set", "model.network.depth=2", "--set", "model.network.decoder_depth=1", "--set", "model.network.embed_dim=32",
               "--set", "model.network.num_heads=2"]


def processes_mentioning(text: str) -> list[int]:
    """Live processes (not zombies) whose command line contains ``text``: the process table."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def start_sweep(runs: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", "import cli; cli.console_main()", "sweep", "--experiment", "owned",
                             "--runs-dir", str(runs), "--stop-grace", "60", *SLOW_ENOUGH],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=runs,
                            start_new_session=True)


def wait_for_a_new_checkpoint(run: Path, sweep_process: subprocess.Popen, timeout: float = 180.0) -> None:
    """Until the run writes ``last.ckpt`` anew (an epoch ended: training is under way)."""
    path = run / "checkpoints" / "last.ckpt"
    before = path.stat().st_mtime_ns if path.exists() else None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime_ns != before:
            return
        if sweep_process.poll() is not None:
            pytest.fail(f"the sweep ended first: {sweep_process.communicate()}")
        time.sleep(0.1)
    pytest.fail("no checkpoint within the time limit")


def wait_until_gone(marker: str, timeout: float = 90.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_mentioning(marker)


@pytest.mark.slow
def test_sigterm_and_sigkill_leave_no_process_and_the_rerun_finishes(tmp_path):
    run = tmp_path / "owned" / "run"
    marker = str(run / "run.yaml")  # every process of the run has it on its command line
    for signum, status in ((signal.SIGTERM, 143),):  # SIGINT takes the same path (the run's own: test_preemption.py)
        process = start_sweep(tmp_path)
        wait_for_a_new_checkpoint(run, process)
        os.kill(process.pid, signum)  # the sweep alone, as `kill PID` or a notebook's stop button
        out, err = process.communicate(timeout=120)
        assert process.returncode == status, (out[-2000:], err[-2000:])
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
        last_line = err.strip().splitlines()[-1]
        assert last_line == (f"shortcutlab sweep: stopped by {signal.Signals(signum).name} (the run in progress "
                             f"ended with status {status}); the same command resumes the sweep"), err[-2000:]
        record = json.loads((run / "sweep.json").read_text())
        assert record["status"] == status and record["stopped_by"] == signal.Signals(signum).name
        assert processes_mentioning(marker) == []  # the sweep waited for its run
    process = start_sweep(tmp_path)
    wait_for_a_new_checkpoint(run, process)
    run_pids = processes_mentioning(marker)
    assert run_pids
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=30)
    assert wait_until_gone(marker) == [], "the run outlived its SIGKILLed sweep"
    # the same command finishes the run, resumed from the checkpoints the stops left
    process = start_sweep(tmp_path)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, (out[-3000:], err[-3000:])
    assert "resumed from" in out and "1 of 1 runs finished" in out
    assert json.loads((run / "sweep.json").read_text())["status"] == 0
    assert json.loads((run / "fit_end.json").read_text())["epochs"] == 12


def test_a_typo_in_a_grid_key_is_refused_before_anything_starts(tmp_path, capsys):
    args = ["--experiment", "typo", "--runs-dir", str(tmp_path), "--config", str(ROOT / "configs" / "digits_mae.yaml"),
            "--grid", "model.network.shortcut.alpha_mim=0.6,1.0"]
    for extra in ([], ["--print"]):
        with pytest.raises(SystemExit) as stop:
            sweep.main([*args, *extra])
        assert stop.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # --print prints no line either
        assert captured.err == (
            "shortcutlab sweep: error: grid point alpha_mim=0.6: "
            "model.init_args.network.init_args.shortcut.init_args.alpha_mim: "
            "unknown key of lightning_mods.backbone.shortcut.ShortcutSchedule; did you mean "
            "'model.init_args.network.init_args.shortcut.init_args.alpha_min'? (nothing was started)\n")
        assert not (tmp_path / "typo").exists()  # no run folder, no plan


def test_a_bad_then_config_is_refused_before_anything_starts(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        sweep.main(["--experiment", "probe", "--runs-dir", str(tmp_path),
                    "--config", str(ROOT / "configs" / "digits_mae.yaml"), "--grid", "seed_everything=0,1",
                    "--then", str(ROOT / "configs" / "linear_probe_digits.yaml"), "--then-set", "model.lr=fast"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("shortcutlab sweep: error: the --then fit of seed=0: model.init_args.lr: must be of type "
                          "float; got 'fast'"), err
    assert not (tmp_path / "probe").exists()
