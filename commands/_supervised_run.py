"""A sweep's child process: one ``shortcutlab`` fit the sweep owns (its own process group, the
sweep's stop signals passed on, killed with the sweep) and a fit resumed from its run folder."""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from commands._run_folder import merge_metrics_csv, resumable_checkpoint


def shell_line(args: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["shortcutlab", *args])


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_GRACE_SECONDS = 120.0  # a signalled run's time to save its checkpoint before SIGKILL (--stop-grace)


class Stopped(Exception):
    """The sweep was sent SIGTERM or SIGINT; its run got the signal too and has ended."""

    def __init__(self, signum: int, status: Optional[int]) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.status = signum, status


def _die_with_the_sweep() -> None:
    """In the run's process, before it starts: SIGTERM when the sweep dies, even by SIGKILL
    (Linux's parent-death signal), so a run never outlives its sweep; SIGTERM makes it save its
    resumable checkpoint first (callbacks/reliability/preemption.py)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the process group and the forwarding remain
        pass


def run_once(args: Sequence[str], log: Path, grace: float = STOP_GRACE_SECONDS) -> tuple[int, float]:
    """Run ``shortcutlab <args>`` in a subprocess, its output to the terminal and to ``log``.

    The run has a process group of its own, which the sweep owns: SIGTERM or SIGINT to the sweep
    is passed on to the run's group, the sweep waits ``grace`` seconds for it to save and exit
    (then SIGKILL, said in one line) and raises :class:`Stopped`. A run also gets SIGTERM when the
    sweep dies (:func:`_die_with_the_sweep`)."""
    start = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-c", "import cli; cli.console_main()", *args]
    received: list[int] = []
    with open(log, "a") as out:
        out.write(f"$ {shell_line(args)}\n")
        out.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                   start_new_session=True, preexec_fn=_die_with_the_sweep)

        def forward(signum: int, frame: Any) -> None:
            if not received:
                received.append(signum)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signum)

        previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
        copier = threading.Thread(target=_copy_output, args=(process, out), daemon=True)
        copier.start()
        try:
            deadline = None
            while process.poll() is None:
                if received and deadline is None:
                    deadline = time.monotonic() + grace
                if deadline is not None and time.monotonic() > deadline:
                    print(f"shortcutlab sweep: the run did not stop within {grace:g} s of "
                          f"{signal.Signals(received[0]).name}; killed it (SIGKILL)", file=sys.stderr, flush=True)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=0.2)
            status = process.wait()
            copier.join(timeout=5)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if not copier.is_alive():
                process.stdout.close()
    if received:
        raise Stopped(received[0], status)
    return status, time.perf_counter() - start


def _copy_output(process: subprocess.Popen, out: Any) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        out.write(line)
        out.flush()
        sys.stdout.write(line)
        sys.stdout.flush()


def fit_resuming(args: Sequence[str], folder: Path, grace: float = STOP_GRACE_SECONDS) -> tuple[list[str], int, float]:
    """Run ``fit`` ``args`` logging to ``folder``, resumed from its last checkpoint when it has
    one (keeping the metrics logged before it); returns ``(arguments run, exit status, seconds)``."""
    resume = resumable_checkpoint(folder)
    metrics = folder / "metrics.csv"
    earlier = metrics.read_text() if resume is not None and metrics.is_file() else None
    run_args = list(args) + ([f"--ckpt_path={resume}"] if resume is not None else [])
    try:
        status, seconds = run_once(run_args, folder / "sweep.log", grace)
    finally:  # also when the sweep was stopped: the rows before the checkpoint stay
        if earlier is not None:
            merge_metrics_csv(earlier, metrics)
            print(f"    resumed from {resume}; the metrics logged before it are kept in {metrics}", flush=True)
    return run_args, status, seconds
