"""How many ATen operations each shipped callback dispatches per training step, on the
quickstart configs: ``python -m benchmarks --only ops``.

On a GPU a dispatched operation costs some 10 us of host time whether its kernel is large or
small, so a callback that loops over tensors in Python slows the step even where its arithmetic
is nothing; counted on the CPU, that loop shows without a GPU. Each callback's per-step hooks
(those of :data:`STEP_HOOKS`) run inside a dispatch-mode counter from step ``warmup`` on; the
count is divided by the steps. The goal is at most :data:`OPS_PER_STEP_GOAL` a step for each
callback: about 1 % of a 50 ms step.

A callback's own forward pass of the network (the online probe embeds a few images every few
steps: that pass is its measurement) is counted on a row of its own, ``<callback>: forward of
the network``, with no goal: its operations are the network's, as many as a training step's
forward, at the callback's cadence.
"""
from __future__ import annotations

import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils._python_dispatch import TorchDispatchMode

from .fit_breakdown import callback_label
from .hook_clock import STEP_HOOKS
from .settings import Settings
from .timing import Row

REPO = Path(__file__).resolve().parents[1]
SECTION = "ATen operations a step, per shipped callback"
OPS_PER_STEP_GOAL = 50
NETWORK_FORWARDS = ("forward_features", "forward_intermediates")  # a callback's forward of the network
FORWARD = "forward of the network"
# between them they carry every shipped callback whose cost is "per step" (callbacks.cost)
CONFIGS = {"quickstart MAE": ["--config=configs/digits_mae.yaml"],
           "quick U-ViT": ["--config=configs/digits_diffusion_quick.yaml"],
           "quick ResNet with ResidualDroppath": ["--config=configs/data/digits.yaml",
                                                   "--config=configs/digits_resnet/base.yaml",
                                                   "--config=configs/rdp/residual_droppath.yaml"]}


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched while it is active, by operation name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class CallbackOpCount(Callback):
    """Counts, per other callback, the ATen operations its per-step hooks dispatch from step
    ``warmup_steps`` on; writes ``{"steps": n, "ops": {callback: count}, "by_op": {...}}`` to
    ``path`` at the end of training."""

    def __init__(self, path: str, warmup_steps: int = 4) -> None:
        self.path = path
        self.warmup_steps = warmup_steps
        self.ops: dict[str, int] = {}
        self.by_op: dict[str, collections.Counter[str]] = {}
        self._first_step: Optional[int] = None
        self._label: Optional[str] = None  # the callback whose hook runs, while counted
        self._network_ops = 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for name in NETWORK_FORWARDS:
            if callable(getattr(pl_module, name, None)):
                setattr(pl_module, name, self._network(getattr(pl_module, name)))
        seen: dict[str, int] = {}
        for callback in trainer.callbacks:
            if callback is self:
                continue
            label = callback_label(callback, seen)
            self.ops[label] = 0
            for hook in STEP_HOOKS:
                if getattr(type(callback), hook) is not getattr(Callback, hook):
                    setattr(callback, hook, self._counted(label, getattr(callback, hook)))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._first_step is None and trainer.global_step >= self.warmup_steps:
            self._first_step = int(trainer.global_step)

    def _counted(self, label: str, method: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._first_step is None:
                return method(*args, **kwargs)
            self._label, self._network_ops = label, 0
            try:
                with OpCounter() as counter:
                    result = method(*args, **kwargs)
            finally:
                self._label = None
            own = sum(counter.ops.values()) - self._network_ops
            self.ops[label] += own
            self.by_op.setdefault(label, collections.Counter()).update(counter.ops)
            if self._network_ops:
                forward = f"{label}: {FORWARD}"
                self.ops[forward] = self.ops.get(forward, 0) + self._network_ops
            return result
        return counted

    def _network(self, method: Callable) -> Callable:
        """``method`` (a forward of the network), its operations inside a counted hook set apart."""
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._label is None:
                return method(*args, **kwargs)
            with OpCounter() as counter:  # inside the hook's: the hook's counter sees these too
                result = method(*args, **kwargs)
            self._network_ops += sum(counter.ops.values())
            return result
        return forward

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        steps = int(trainer.global_step) - (self._first_step if self._first_step is not None else trainer.global_step)
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps({"steps": steps, "ops": self.ops,
                                                   "by_op": {k: dict(v.most_common(8)) for k, v in self.by_op.items()}}))


def counted_fit_arguments(fit_args: list[str], steps: int, warmup: int, root: Path) -> list[str]:
    """``shortcutlab fit`` arguments of a counted fit of ``warmup + steps`` steps (validation off,
    CPU, fp32, the progress bar on as shipped); the record goes to ``root/ops.json``."""
    return ["fit", *fit_args, f"--trainer.max_steps={warmup + steps}", "--trainer.max_epochs=-1",
            "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true",
            f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=true",
            "--trainer.limit_val_batches=0", "--trainer.callbacks+=benchmarks.op_counts.CallbackOpCount",
            f"--trainer.callbacks.path={root / 'ops.json'}", f"--trainer.callbacks.warmup_steps={warmup}"]


def per_step(record: Path) -> dict[str, Any]:
    """A counted fit's record as operations per step."""
    result = json.loads(record.read_text())
    counted = max(1, result["steps"])
    return {"steps": result["steps"], "per_step": {k: v / counted for k, v in result["ops"].items()},
            "by_op": result["by_op"]}


def count(fit_args: list[str], steps: int, warmup: int, root: Path) -> dict[str, Any]:
    """Per-step ATen operations of each callback of one ``shortcutlab fit`` of ``warmup + steps``
    steps (validation off, CPU, fp32), run in its own process."""
    command = [sys.executable, "-m", "cli", *counted_fit_arguments(fit_args, steps, warmup, root)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0 or not (root / "ops.json").is_file():
        raise RuntimeError(f"op count fit failed: {(done.stderr.strip().splitlines() or ['(no output)'])[-1]}")
    return per_step(root / "ops.json")


def run(settings: Settings) -> list[Row]:
    steps, warmup = settings.pick((24, 4), (8, 4))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name, args in CONFIGS.items():
            counted = count(args, steps, warmup, Path(scratch) / name.replace(" ", "_"))
            for callback, ops in sorted(counted["per_step"].items(), key=lambda kv: -kv[1]):
                top = ", ".join(f"{op} {n}" for op, n in list(counted["by_op"].get(callback, {}).items())[:4])
                goal = None if callback.endswith(FORWARD) else f"<= {OPS_PER_STEP_GOAL}"
                rows.append(Row(f"{SECTION}: {name}", callback, ops, ops, goal, "ops",
                                f"over {counted['steps']} steps" + (f"; most: {top}" if top else "")))
    return rows
