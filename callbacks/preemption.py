"""Pre-emption: SIGTERM or SIGINT during a fit writes a resumable checkpoint and ends the
process with status ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), as a shell reports a
process killed by that signal, so a scheduler never takes a killed run for a finished one.

The signal only raises Lightning's own stop flag (its SIGTERM handler, which also forwards the
signal to DDP worker processes and broadcasts the decision to every rank): the loop finishes
the training batch in progress, with every callback's hooks, the optimiser and scheduler
steps and the progress counters, then raises Lightning's ``SIGTERMException``. This
callback's ``on_exception`` then writes ``last.ckpt`` into the ModelCheckpoint folder
(``<default_root_dir>/checkpoints`` without one): ``fit --ckpt_path <it>`` resumes exactly, with
``callbacks.exact_resume.ExactResume``. A signal during validation stops at the next
validation batch, and the checkpoint resumes that validation (holding the training weights, not
the averaged ones an EMA callback swapped in for it). The ``shortcutlab`` command
turns the exception into the exit status of :func:`received_signal`. A second SIGINT
interrupts at once (Python's ``KeyboardInterrupt``). No checkpoint is written over non-finite
weights.

SLURM: with Lightning's ``SLURMEnvironment(auto_requeue=True)`` (the default under SLURM), the
requeue signal (``SIGUSR1``, e.g. ``#SBATCH --signal=SIGUSR1@90``) is Lightning's: it writes
``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, requeues the job with ``scontrol requeue``, and
the requeued job resumes from that file by itself.
"""
from __future__ import annotations

import math
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_mods import checkpoint_io

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: Optional[int] = None  # signals are process-wide: the first one a fit received


def received_signal() -> Optional[int]:
    """The signal that stopped the last fit of this process (None: none did)."""
    return _received


class PreemptionCheckpoint(Callback):
    """On SIGTERM/SIGINT: checkpoint after the training batch in progress, then stop (see the
    module docstring)."""

    def __init__(self, filename: str = "last") -> None:
        super().__init__()
        self.filename = filename
        self.saved_path: Optional[Path] = None
        self._previous: dict[int, Any] = {}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        checkpoint_io.install(trainer)  # the pre-emption save is whole or absent, last.ckpt never half replaced

    # --- signal handlers (main thread only: Python's rule) ------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        global _received
        _received, self.saved_path = None, None
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in HANDLED_SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        global _received
        if signum == signal.SIGINT and _received == signal.SIGINT:  # second Ctrl+C: stop now
            raise KeyboardInterrupt
        if _received is None:
            _received = signum
        lightning_stop = self._previous.get(signal.SIGTERM)  # Lightning's: sets trainer.received_sigterm
        if callable(lightning_stop):
            lightning_stop(signal.SIGTERM, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def _restore_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_handlers()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore_handlers()

    # --- the checkpoint -----------------------------------------------------------------------
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore_handlers()
        if not isinstance(exception, SIGTERMException) or trainer.sanity_checking:
            return
        name = signal.Signals(_received or signal.SIGTERM).name
        if trainer.state.fn != TrainerFn.FITTING:  # nothing to resume, and a last.ckpt without
            if trainer.is_global_zero:             # optimiser state must not replace the fit's
                print(f"shortcutlab: stopped by {name} during {trainer.state.fn.value}; no checkpoint written",
                      file=sys.stderr)
            return
        if trainer.validating:
            end_weight_averaging_validation(trainer, pl_module)
        weights = [p.detach() for p in pl_module.parameters()]
        if weights and not math.isfinite(float(torch.nn.utils.get_total_norm(weights, norm_type=math.inf))):
            message = f"shortcutlab: stopped by {name} at step {trainer.global_step}; no checkpoint (non-finite weights)"
        else:
            self.saved_path = self._directory(trainer) / f"{self.filename}.ckpt"
            trainer.save_checkpoint(self.saved_path, weights_only=False)  # the full resumable state, said explicitly
            message = (f"shortcutlab: stopped by {name} at step {trainer.global_step}; resumable checkpoint "
                       f"{self.saved_path} (resume: fit ... --ckpt_path {self.saved_path})")
        if trainer.is_global_zero:
            print(message, file=sys.stderr)

    @staticmethod
    def _directory(trainer: Trainer) -> Path:
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                return Path(callback.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"


def end_weight_averaging_validation(trainer: Trainer, pl_module: LightningModule) -> None:
    """Give the module its training weights back from a weight-averaging callback (EMA) that
    swapped the averaged ones in for validation. A signal stops validation between the
    callback's ``on_validation_epoch_start`` (swap in) and ``on_validation_epoch_end`` (swap
    back); saved then, the checkpoint would hold the training weights as the averaged
    ``state_dict`` and the averaged ones as ``current_model_state``, and the resumed fit would
    train on from the averaged weights."""
    for callback in trainer.callbacks:
        if isinstance(callback, WeightAveraging):
            callback.on_validation_epoch_end(trainer, pl_module)
