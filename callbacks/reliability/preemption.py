"""Pre-emption: SIGTERM or SIGINT during a fit writes a resumable checkpoint and ends the
process with status ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), as a shell reports a
process killed by that signal, so a scheduler never takes a killed run for a finished one.

The signal only raises Lightning's stop flag (``trainer.received_sigterm``): the loop finishes
the training batch in progress, with every callback's hooks, the optimiser and scheduler steps
and the progress counters, then raises Lightning's ``SIGTERMException``; ``on_exception`` writes
``last.ckpt`` into the ModelCheckpoint folder (``<default_root_dir>/checkpoints`` without one),
from which ``fit --ckpt_path <it>`` resumes exactly (``callbacks.reliability.exact_resume.ExactResume``).
The ``shortcutlab`` command turns the exception into the exit status of :func:`received_signal`.
A second SIGINT interrupts at once (Python's ``KeyboardInterrupt``); a later SIGTERM or requeue
signal is ignored once the stop is decided (SLURM answers ``scontrol requeue`` with SIGTERM: the
checkpoint is finished and the exit status stays the first signal's). No checkpoint is written
over non-finite weights.

- **During validation** the signal lets the validation finish (its metrics logged, an averaging
  callback's weights swapped back; one line says so) and the fit stops at the end of the epoch,
  or of the next training step for a validation inside the epoch. Resumed from the middle of a
  validation, Lightning logs neither that validation's metrics nor the epoch's, so the resumed
  run would not be the uninterrupted one.
- **Under DDP** every rank stops after the same step: the handler only notes the signal, and
  every ``check_every_n_steps`` steps (default: the trainer's ``log_every_n_steps``), at each
  epoch's end and after each validation one ``all_reduce`` of the ranks' notes decides for all of
  them, whether the signal reached every task or only one. (Lightning's own handler broadcasts
  from inside the handler and its per-step check reads rank 0's flag alone: a signal on another
  rank stopped that rank only, and the others hung.) The reduction replaces Lightning's per-step
  broadcast and host read of the flag, so the steps in between make no collective for it.

SLURM: the requeue signal (``requeue_signal``, default ``SIGUSR1``: ``#SBATCH --signal=SIGUSR1@90``)
is a pre-emption like SIGTERM: the step in progress finishes, the same exact ``last.ckpt`` is
written, then global rank 0 asks SLURM to requeue the job (``scontrol requeue <SLURM_JOB_ID>``, or
``<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>`` for an array task), one line says so and the process
exits with ``128 + signal`` (138 for SIGUSR1). Lightning's own SLURM handler of that signal, which
writes ``hpc_ckpt_<n>.ckpt`` from inside the handler wherever the step is (a requeued job resumed
from it is not the uninterrupted run), is switched off. The requeued job, the same command,
resumes from the newest checkpoint by itself (``SLURM_RESTART_COUNT > 0``, or ``--ckpt_path auto``
from any launcher: ``commands/lightning_cli.py``).
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_mods.checkpointing import checkpoint_io
from lightning_mods._compat import lightning_private
from callbacks.reliability.nonfinite_guard import NonFiniteTrainingError
from callbacks.schedule import check_step_cadence, every_n_steps_or_logging
from callbacks.cost import PER_STEP

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REQUEUE_SIGNAL = "SIGUSR1"  # SLURM's --signal of the papers' job scripts
_received: Optional[int] = None  # signals are process-wide: the first one a fit received
_ignored: dict[int, Any] = {}  # signals ignored since a pre-emption stop, and their handlers before it


def received_signal() -> Optional[int]:
    """The signal that stopped the last fit of this process (None: none did)."""
    return _received


def restore_stop_signals() -> None:
    """Handle SIGTERM and the requeue signal again as before a pre-emption stop (which ignores
    them until the process exits: ``PreemptionCheckpoint._ignore_further_stop_signals``)."""
    global _ignored
    for signum, handler in _ignored.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    _ignored = {}


class PreemptionCheckpoint(Callback):
    """On SIGTERM/SIGINT (and the requeue signal): checkpoint after the training batch in
    progress, then stop (see the module docstring).

    Args:
        filename: of the checkpoint, in the ModelCheckpoint folder.
        requeue_signal: the signal that also requeues the SLURM job (None: none does).
        check_every_n_steps: under DDP, optimiser steps between the ranks' stop decisions
            (``None``: the trainer's ``log_every_n_steps``); also decided at every epoch's end
            and after every validation. One process stops after the step the signal arrived in.
            A signal's lead time must cover that many steps (SLURM: ``--signal=SIGUSR1@90``).
    """
    cost = PER_STEP

    def __init__(self, filename: str = "last", requeue_signal: Optional[str] = REQUEUE_SIGNAL,
                 check_every_n_steps: Optional[int] = None) -> None:
        super().__init__()
        self.check_every_n_steps = check_step_cadence("PreemptionCheckpoint", check_every_n_steps)
        self._decided_step = -1
        if requeue_signal is not None and (not isinstance(requeue_signal, str)
                                           or not isinstance(getattr(signal, requeue_signal, None), signal.Signals)):
            raise ValueError(f"PreemptionCheckpoint: requeue_signal must be a signal name such as 'SIGUSR1' or "
                             f"null, got {requeue_signal!r}")
        self.filename = filename
        self.requeue_signal = signal.Signals[requeue_signal] if requeue_signal else None
        self.saved_path: Optional[Path] = None
        self._previous: dict[int, Any] = {}
        self._trainer: Optional[Trainer] = None
        self._noted = [0, 0, 0]  # SIGTERM, SIGINT, requeue signal seen by this rank (DDP: until the ranks agree)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        checkpoint_io.install(trainer)  # the pre-emption save is whole or absent, last.ckpt never half replaced
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if environment is None:  # a single-device strategy has none; Lightning's signal handlers read this one
            environment = lightning_private.connector_cluster_environment(trainer)
        if isinstance(environment, SLURMEnvironment):  # its requeue handler saves mid-step: this one replaces it
            environment.auto_requeue = False

    # --- signal handlers (main thread only: Python's rule) ------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        global _received
        _received, self.saved_path, self._noted, self._decided_step = None, None, [0, 0, 0], -1
        self._trainer = trainer
        if _distributed(trainer):  # the ranks' stop decision is this callback's all_reduce (module docstring)
            lightning_private.without_sigterm_broadcast(trainer)
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in HANDLED_SIGNALS + ((self.requeue_signal,) if self.requeue_signal else ()):
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        global _received
        if signum == signal.SIGINT and _received == signal.SIGINT:  # second Ctrl+C: stop now
            raise KeyboardInterrupt
        trainer = self._trainer
        if trainer is None:  # the handlers are installed only while a fit trains
            return
        first = _received is None
        if first:
            _received = signum
        self._noted[self._signal_index(signum)] = 1
        launcher = trainer.strategy.launcher
        if first and launcher is not None:  # DDP workers Lightning started get SIGTERM (a Ctrl+C reaches
            launcher.kill(signal.SIGTERM)    # them already: a forwarded SIGINT would be their second)
        if trainer.validating:
            if first and trainer.is_global_zero:
                print(f"shortcutlab: {signal.Signals(signum).name} during validation: stopping when it ends"
                      + (" (Ctrl+C again stops now, without a checkpoint)" if signum == signal.SIGINT else ""),
                      file=sys.stderr, flush=True)
        elif not _distributed(trainer):
            lightning_private.raise_stop_flag(trainer)

    def _signal_index(self, signum: int) -> int:
        return 2 if signum == self.requeue_signal else (1 if signum == signal.SIGINT else 0)

    def _decide(self, trainer: Trainer) -> None:
        """Raise the stop flag if a signal was noted (under DDP: on any rank, one all_reduce)."""
        global _received
        if trainer.received_sigterm:
            return
        noted = self._noted
        if _distributed(trainer):
            reduced = torch.tensor(noted, dtype=torch.int32, device=trainer.strategy.root_device)
            torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
            noted = reduced.tolist()
        term, interrupt, requeue = noted
        if term or interrupt or requeue:  # one signal for every rank: the same message and exit status
            _received = self.requeue_signal if requeue else (signal.SIGTERM if term else signal.SIGINT)
            lightning_private.raise_stop_flag(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not _distributed(trainer):  # alone, the handler raised the flag already
            return
        step = int(trainer.global_step)
        if step % every_n_steps_or_logging(trainer, self.check_every_n_steps) == 0 and step != self._decided_step:
            self._decided_step = step
            self._decide(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if _distributed(trainer):
            self._decide(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._trainer is trainer and not trainer.sanity_checking:
            self._decide(trainer)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_handlers()
        self._trainer = None

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore_handlers()

    # --- the checkpoint -----------------------------------------------------------------------
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore_handlers()
        if not isinstance(exception, SIGTERMException) or trainer.sanity_checking:
            return
        name = signal.Signals(_received or signal.SIGTERM).name
        self._ignore_further_stop_signals(trainer)
        if trainer.state.fn != TrainerFn.FITTING:  # nothing to resume, and a last.ckpt without
            if trainer.is_global_zero:             # optimiser state must not replace the fit's
                print(f"shortcutlab: stopped by {name} during {trainer.state.fn.value}; no checkpoint written",
                      file=sys.stderr)
            return
        weights = [p.detach() for p in pl_module.parameters()]
        if weights and not math.isfinite(float(torch.nn.utils.get_total_norm(weights, norm_type=math.inf))):
            message = f"shortcutlab: stopped by {name} at step {trainer.global_step}; no checkpoint (non-finite weights)"
        else:
            self.saved_path = self._directory(trainer) / f"{self.filename}.ckpt"
            for callback in trainer.checkpoint_callbacks:  # this file is their last.ckpt now: a resumed
                if isinstance(callback, ModelCheckpoint) and callback.save_last \
                        and callback.dirpath and Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}.ckpt" == self.saved_path:
                    callback.last_model_path = str(self.saved_path)  # fit in this folder replaces it, not last-v1.ckpt
            try:  # the full resumable state, said explicitly
                trainer.save_checkpoint(self.saved_path, weights_only=False)
                checkpoint_io.finish_writes(trainer)  # on disk before the process exits
            except NonFiniteTrainingError as diverged:  # NonFiniteGuard's read before the file is opened
                self.saved_path = None
                message = f"shortcutlab: stopped by {name} at step {trainer.global_step}; no checkpoint ({diverged})"
            else:
                message = (f"shortcutlab: stopped by {name} at step {trainer.global_step}; resumable checkpoint "
                           f"{self.saved_path} (resume: fit ... --ckpt_path {self.saved_path})")
                if _received == self.requeue_signal and trainer.is_global_zero:
                    message += "; " + requeue_slurm_job()
        if trainer.is_global_zero:
            print(message, file=sys.stderr)

    def _ignore_further_stop_signals(self, trainer: Trainer) -> None:
        """The stop is decided: a later SIGTERM (SLURM answers ``scontrol requeue`` with one) or
        requeue signal must neither cut the checkpoint short nor change the exit status. They are
        ignored from here until the process exits, through Lightning's teardown too (which puts
        back the handlers it found: it finds these). :func:`restore_stop_signals` takes them back
        in a process that goes on (Python, not the command)."""
        if threading.current_thread() is not threading.main_thread():
            return
        originals = lightning_private.original_signal_handlers(trainer)
        for signum in (signal.SIGTERM,) + ((self.requeue_signal,) if self.requeue_signal else ()):
            previous = signal.signal(signum, signal.SIG_IGN)
            _ignored.setdefault(signum, originals.get(signum, previous))  # what was there before the fit
            originals[signum] = signal.SIG_IGN

    @staticmethod
    def _directory(trainer: Trainer) -> Path:
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                return Path(callback.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"


def _distributed(trainer: Trainer) -> bool:
    return trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def slurm_job_id() -> Optional[str]:
    """The id ``scontrol requeue`` takes: ``<array job>_<task>`` for an array task, else the job's."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID") or None


def requeue_slurm_job() -> str:
    """``scontrol requeue <job id>``; the words that say what happened."""
    job = slurm_job_id()
    if job is None:
        return "not a SLURM job (no SLURM_JOB_ID): nothing requeued"
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job):
        return f"SLURM job id {job!r} is not a job id: nothing requeued"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"requeueing SLURM job {job} failed ({err}); requeue it by hand"
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        return (f"requeueing SLURM job {job} failed (scontrol exit status {done.returncode}"
                + (f": {reason[-1]}" if reason else "") + "); requeue it by hand")
    return f"requeued SLURM job {job} (scontrol requeue {job}); it resumes from the newest checkpoint"
