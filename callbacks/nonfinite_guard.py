"""Stop a diverged fit at the step it diverged, before anything non-finite is saved.

Three checks per optimiser step, each the same decision on every rank (any rank's failure
stops all of them):

- ``on_before_backward``: the training loss is finite;
- ``on_before_optimizer_step``: every gradient is finite and, where gradient clipping by norm
  is on, so is the gradient 2-norm over all parameters (clipping divides by it); not under
  fp16 mixed precision, whose GradScaler skips such steps by design;
- ``on_train_batch_end``: every parameter is finite after the step (a finite but huge update
  can overflow). Checkpoint callbacks run after every other callback, so the step that made
  the weights non-finite never reaches them.

The first two stop before ``optimizer.step``: the weights in memory are still the last good
ones. A failure raises :class:`NonFiniteTrainingError` with one line naming the step and the
value; the ``shortcutlab`` command prints it and exits with status 3. Nothing is saved on that
exception (``callbacks.preemption`` writes its checkpoint only for signals), so the last
checkpoint on disk is the last good one.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class NonFiniteTrainingError(RuntimeError):
    """Training produced a NaN or infinite loss, gradient norm or weight."""


class NonFiniteGuard(Callback):
    """Raise :class:`NonFiniteTrainingError` at the first non-finite loss, gradient norm or
    weight of a fit (see the module docstring)."""

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        value = float(loss.detach().float())
        self._check(trainer, "training loss", value)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            return  # fp16's GradScaler skips steps with inf gradients by design
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "norm":
            # clipping divides by the 2-norm: one that overflows turns every weight into NaN
            self._check(trainer, "gradient norm", float(torch.nn.utils.get_total_norm(grads, norm_type=2.0)))
        else:
            self._check(trainer, "largest gradient magnitude",
                        float(torch.nn.utils.get_total_norm(grads, norm_type=math.inf)))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        params = [p.detach() for p in pl_module.parameters()]
        if params:  # the largest magnitude: finite exactly when every weight is
            largest = float(torch.nn.utils.get_total_norm(params, norm_type=math.inf))
            self._check(trainer, "largest weight magnitude after the step", largest, after_step=True)

    @staticmethod
    def _check(trainer: Trainer, what: str, value: float, after_step: bool = False) -> None:
        bad = not math.isfinite(value)
        if not trainer.strategy.reduce_boolean_decision(bad, all=False):
            return
        step = int(trainer.global_step) - (1 if after_step else 0)
        where = f"step {step} (epoch {trainer.current_epoch}, batch {trainer.fit_loop.epoch_loop.batch_idx})"
        shown = f"{value}" if bad else "finite here, non-finite on another rank"
        raise NonFiniteTrainingError(f"non-finite {what} ({shown}) at {where}; training stopped, "
                                     "the last checkpoint on disk is the last good one")
