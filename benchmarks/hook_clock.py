"""The benchmarks' one clock of a fit: seconds inside hooks, and between two of the Trainer's hooks.

- :meth:`HookClock.watch` times named methods of a target (a callback's hooks, the
  LightningModule's, or any method such as ``KNNEvaluator.evaluate``) under a name;
- :meth:`HookClock.span` times the stretch from one of the Trainer's hooks to another (a training
  epoch, a validation).

Every timed call is kept as ``(name, hook, epoch, seconds)``. On CUDA each timed stretch is
synchronised at both ends, so the GPU work queued inside it counts. The clock is a callback: pass
it to the Trainer, where it follows the epoch and, with ``from_step``, times nothing before that
optimiser step (the warm-up).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from .timing import synchronize

STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
              "on_before_optimizer_step", "on_before_zero_grad")  # a callback's hooks that run every step
TRAIN_HOOKS = (*STEP_HOOKS, "on_train_epoch_start", "on_train_epoch_end")
VALIDATION_HOOKS = ("on_validation_start", "on_validation_epoch_start", "on_validation_batch_start",
                    "on_validation_batch_end", "on_validation_epoch_end", "on_validation_end")
END_HOOKS = ("on_train_end", "on_fit_end")
SPAN_HOOKS = ("on_train_epoch_start", "on_train_epoch_end", "on_validation_start", "on_validation_end",
              "on_train_end")  # the Trainer's hooks a span can start or end at


class Call(NamedTuple):
    name: str
    hook: str
    epoch: int
    seconds: float


class HookClock(Callback):
    """Seconds inside watched hooks and between spanned ones (see the module docstring).
    ``device``: where to synchronise (default: the Trainer's root device)."""

    def __init__(self, device: Optional[torch.device] = None, from_step: int = 0) -> None:
        self.device = device
        self.from_step = from_step
        self.calls: list[Call] = []
        self.first_timed_step: Optional[int] = None
        self._epoch = 0
        self._spans: dict[str, tuple[str, str]] = {}  # name -> (start hook, end hook)
        self._open: dict[str, float] = {}

    # --- what is timed ---------------------------------------------------------------------------
    def watch(self, name: str, target: object, hooks: Iterable[str] = (*TRAIN_HOOKS, *VALIDATION_HOOKS, *END_HOOKS)
              ) -> None:
        """Time ``target``'s methods ``hooks`` (those it has) under ``name``."""
        for hook in hooks:
            method = getattr(target, hook, None)
            if method is not None:
                setattr(target, hook, self._timed(name, hook, method))

    def span(self, name: str, start: str, end: str) -> None:
        """Time each stretch from the Trainer's hook ``start`` to its hook ``end`` (of :data:`SPAN_HOOKS`)."""
        if start not in SPAN_HOOKS or end not in SPAN_HOOKS:
            raise ValueError(f"HookClock.span: {start!r} and {end!r} must be among {SPAN_HOOKS}")
        self._spans[name] = (start, end)

    @property
    def timing(self) -> bool:
        return self.first_timed_step is not None

    def _sync(self) -> None:
        if self.device is not None:
            synchronize(self.device)

    def _timed(self, name: str, hook: str, method: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.timing:
                return method(*args, **kwargs)
            self._sync()
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._sync()
                self.calls.append(Call(name, hook, self._epoch, time.perf_counter() - start))
        return timed

    def _mark(self, hook: str) -> None:
        if not self._spans or not self.timing:
            return
        self._sync()
        now = time.perf_counter()
        for name, (start, end) in self._spans.items():
            if hook == end and name in self._open:
                self.calls.append(Call(name, f"{start}..{end}", self._epoch, now - self._open.pop(name)))
            if hook == start:
                self._open[name] = now

    # --- the Trainer's hooks ---------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.device is None:
            self.device = trainer.strategy.root_device
        if self.from_step <= 0:
            self.first_timed_step = int(trainer.global_step)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.first_timed_step is None and trainer.global_step >= self.from_step:
            self.first_timed_step = int(trainer.global_step)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch = int(trainer.current_epoch)
        self._mark("on_train_epoch_start")

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark("on_train_epoch_end")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark("on_validation_start")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark("on_validation_end")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._mark("on_train_end")

    # --- what was measured -----------------------------------------------------------------------
    def seconds(self, name: str, hooks: Optional[Sequence[str]] = None, epoch: Optional[int] = None) -> float:
        """The seconds of ``name``'s calls, of ``hooks`` only and of one ``epoch`` when given."""
        return sum(c.seconds for c in self.calls if c.name == name and (hooks is None or c.hook in hooks)
                   and (epoch is None or c.epoch == epoch))

    def per_epoch(self, name: str, hooks: Optional[Sequence[str]], epochs: int) -> list[float]:
        return [self.seconds(name, hooks, epoch) for epoch in range(epochs)]

    def per_call(self, name: str) -> list[float]:
        return [c.seconds for c in self.calls if c.name == name]
