"""Stop a diverged fit, naming the step it diverged at, before anything non-finite is saved
(no host sync or collective per step).

Every optimiser step notes two values, kept on the training device and never read back there:

- ``on_before_backward``: is the training loss finite;
- ``on_before_optimizer_step``: is the gradient 2-norm over all parameters finite (every
  gradient finite, and their squares' sum, which clipping by norm divides by, not overflowing);
  not under fp16 mixed precision, whose GradScaler skips such steps by design.

A step only keeps a reference to each value (no kernel, no host read). At a read the values
noted since the last one are folded into a small record on the device, per check the first step
that failed it and the value there, and the record is read (one host read; under DDP one
``all_reduce`` of it, so every rank decides alike). Reads happen only:

- every ``check_every_n_steps`` optimiser steps (default: the trainer's ``log_every_n_steps``);
- before every checkpoint is written (``on_save_checkpoint``, which Lightning calls for every
  ``ModelCheckpoint`` save, ``last.ckpt`` and the pre-emption checkpoint, before the file is
  written): a read there also checks every weight, so a finite loss and finite gradients whose
  update overflowed are caught too;
- before each validation of the fit and when training ends.

A failed read raises :class:`NonFiniteTrainingError` with one line naming the first step that
failed and its value; the ``shortcutlab`` command prints it and exits with status 3. The
exception is raised inside the checkpoint save, before the file is opened, so no checkpoint of
a diverged run is ever written and the last one on disk is the last good one. Between reads the
weights in memory may already be non-finite; nothing is saved from them.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from callbacks._utils.distributed import all_reduce_min
from callbacks.schedule import check_step_cadence, every_n_steps_or_logging
from callbacks.cost import PER_STEP

NEVER = torch.iinfo(torch.int64).max  # "no step failed this check" in the record
CHECKS = ("training loss", "gradient norm", "weight")
FOLD_AFTER = 1024  # values noted per check before they are folded without a read (a long cadence)


class NonFiniteTrainingError(RuntimeError):
    """Training produced a NaN or infinite loss, gradient norm or weight."""


class NonFiniteGuard(Callback):
    """Raise :class:`NonFiniteTrainingError` after a non-finite loss, gradient or weight, at the
    next read of the on-device record (see the module docstring).

    Args:
        check_every_n_steps: optimiser steps between reads (``None``: the trainer's
            ``log_every_n_steps``); reads before checkpoints, validations and the end of
            training come on top.
    """
    cost = PER_STEP

    def __init__(self, check_every_n_steps: Optional[int] = None) -> None:
        self.check_every_n_steps = check_step_cadence("NonFiniteGuard", check_every_n_steps)
        self._first_step: Optional[torch.Tensor] = None  # per check: the first step that failed it
        self._first_value: Optional[torch.Tensor] = None  # per check: the value at that step
        self._noted: list[list[tuple[int, torch.Tensor]]] = [[] for _ in CHECKS]  # (step, value) since the last fold
        self._where: dict[int, tuple[int, int]] = {}  # step -> (epoch, batch) since the last read
        self._last_read_step = -1

    @property
    def state_key(self) -> str:
        return self._generate_state_key(check_every_n_steps=self.check_every_n_steps)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = trainer.strategy.root_device
        self._first_step = torch.full((len(CHECKS),), NEVER, dtype=torch.int64, device=device)
        self._first_value = torch.zeros(len(CHECKS), dtype=torch.float32, device=device)
        self._noted = [[] for _ in CHECKS]
        self._where, self._last_read_step = {}, int(trainer.global_step)

    # --- the per-step record (no kernel, no host read) -------------------------------------------
    def _note(self, trainer: Trainer, check: int, value: torch.Tensor) -> None:
        if self._first_step is None:  # hooks called outside a fit's training (e.g. by hand)
            self.on_train_start(trainer, trainer.lightning_module)
        step = int(trainer.global_step)
        self._where.setdefault(step, (int(trainer.current_epoch), int(trainer.fit_loop.epoch_loop.batch_idx)))
        self._noted[check].append((step, value.detach()))
        if len(self._noted[check]) >= FOLD_AFTER:
            self._fold()

    def _fold(self) -> None:
        """Fold the values noted since the last fold into the record: device work, no host read."""
        device = self._first_step.device
        for check, noted in enumerate(self._noted):
            if not noted:
                continue
            steps = torch.tensor([step for step, _ in noted], dtype=torch.int64)
            if device.type == "cuda":  # a pinned, asynchronous copy: no wait for the queued kernels
                steps = steps.pin_memory()
            steps = steps.to(device, non_blocking=True)
            values = torch.stack([value.float().reshape(()).to(device) for _, value in noted])
            bad = torch.logical_not(torch.isfinite(values))
            first = torch.argmax(bad.to(torch.uint8))  # the first bad value (argmax: its first maximum)
            newly_bad = bad.any() & (self._first_step[check] == NEVER)
            self._first_step[check : check + 1].masked_fill_(newly_bad, steps[first])
            self._first_value[check] = torch.where(newly_bad, values[first], self._first_value[check])
            noted.clear()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._note(trainer, 0, loss)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            return  # fp16's GradScaler skips steps with inf gradients by design
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        # the 2-norm over all parameters: finite exactly when every gradient is finite and their
        # squares' sum does not overflow (which clipping by norm and Adam's second moment would),
        # and torch's CPU kernel for it is several times faster than the max-norm's
        self._note(trainer, 1, total_norm(grads))

    # --- the reads --------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = int(trainer.global_step)
        if step != self._last_read_step and step % every_n_steps_or_logging(trainer, self.check_every_n_steps) == 0:
            self.check(trainer, pl_module)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if trainer.state.fn == "fit":
            self.check(trainer, pl_module, weights=True)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.check(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.check(trainer, pl_module, weights=True)

    def check(self, trainer: Trainer, pl_module: LightningModule, weights: bool = False) -> None:
        """Read the record (and, with ``weights``, check every weight): raise if any check failed
        on any rank. Every rank must call it at the same point (it reduces over them)."""
        if self._first_step is None:
            return  # no training step recorded yet
        step = int(trainer.global_step)
        self._fold()
        record = self._first_step.clone()
        if weights:
            params = [p.detach() for p in pl_module.parameters()]
            if params:  # the largest magnitude: finite exactly when every weight is
                largest = torch.nn.utils.get_total_norm(params, norm_type=math.inf).to(record.device)
                record[2:3].masked_fill_(torch.logical_not(torch.isfinite(largest)), step)
                self._first_value[2] = largest.float()
        # the one host read (and, under DDP, the one collective) of a check: every rank's and this one's
        first, local = torch.stack([all_reduce_min(record), record]).tolist()
        self._last_read_step = step
        failed = min(range(len(CHECKS)), key=lambda j: (first[j], j))
        if first[failed] == NEVER:
            self._where.clear()
            return
        what = CHECKS[failed]
        if failed == 2:
            at = f"the read at step {first[failed]} (loss and gradients finite until then)"
        else:
            epoch, batch = self._where.get(first[failed], (None, None))
            at = f"step {first[failed]}" + (f" (epoch {epoch}, batch {batch})" if epoch is not None else "")
        shown = f"{float(self._first_value[failed])}" if local[failed] == first[failed] else "on another rank"
        raise NonFiniteTrainingError(f"non-finite {what} ({shown}) at {at}; training stopped, "
                                     "the last checkpoint on disk is the last good one")


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over all ``grads``, as ``torch.nn.utils.get_total_norm``, without its grouping
    by device and dtype (a fifth of the check's time on the quickstart): the per-tensor norms are
    stacked, dtypes promoted as that function's stack promotes them; gradients on several
    devices go through that function."""
    norms = torch._foreach_norm(grads, 2.0)
    try:
        stacked = torch.stack(norms)
    except RuntimeError:  # norms on several devices
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    return torch.linalg.vector_norm(stacked)
