"""What one run of the suite measures on: device, precision, sizes and rounds."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch


@dataclass
class Settings:
    """``quick``: tiny models and one round (the smoke test); ``rounds``: interleaved rounds per
    figure; ``compile``: also time ``nn.Module.compile`` (cold compiles take ~50 s on 2 cores)."""

    device: str = "cpu"
    precision: str = "32-true"
    quick: bool = False
    rounds: int = 5
    compile: bool = False

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def on_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def autocast(self) -> ContextManager:
        """bf16 autocast under ``bf16-mixed``, nothing under ``32-true``."""
        if self.precision == "bf16-mixed":
            return torch.autocast(self.torch_device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def pick(self, full: object, quick: object) -> object:
        return quick if self.quick else full

    def calls(self, full: int) -> int:
        """Calls per variant and round: ``full``, one in quick mode."""
        return 1 if self.quick else full

    @property
    def max_batches(self) -> int | None:
        """Training batches per epoch of the Lightning figures (all; two in quick mode)."""
        return 2 if self.quick else None


def train_step(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module], torch.Tensor],
               settings: Settings, optimizer: torch.optim.Optimizer | None = None) -> Callable[[], None]:
    """One training step: forward (under the precision's autocast), backward, optimiser step
    when one is given (else gradients are just freed)."""

    def step() -> None:
        with settings.autocast():
            loss = loss_fn(model).float()
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            for p in model.parameters():
                p.grad = None

    return step
