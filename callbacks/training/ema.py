"""EMA weights for the diffusion models without a host read per step (no per-step
host syncs; U-ViT's EMA of the decay paper, section 5).

Lightning's ``EMAWeightAveraging`` updates torch's ``AveragedModel`` after every optimiser step,
and ``AveragedModel.update_parameters`` branches on its ``n_averaged`` buffer twice
(``bool(n_averaged == 0)``, ``n_averaged > 0``): that buffer lives with the model, so on a GPU
every update waits for the device. :class:`EMA` is that callback with an averaged model that
also counts its updates on the host (read from the buffer once, when it is first needed after
a checkpoint is loaded) and updates every tensor with the same arithmetic as torch's
``get_ema_avg_fn`` (``decay * average + (1 - decay) * current``), grouped in multi-tensor calls:
the same averaged weights, bit for bit, checkpoints in the same layout.
"""
from __future__ import annotations

import itertools
from typing import Any, Optional, Union

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.optim.swa_utils import AveragedModel


class HostCountedEMAModel(AveragedModel):
    """``AveragedModel`` with an exponential moving average of ``decay`` whose update reads no
    tensor: the count of updates is kept on the host as well as in ``n_averaged``."""

    def __init__(self, model: nn.Module, decay: float, device: Optional[Union[torch.device, str, int]] = None,
                 use_buffers: bool = False) -> None:
        super().__init__(model, device=device, use_buffers=use_buffers)
        self.decay = float(decay)
        self._updates: Optional[int] = 0  # None: not known on the host (a state was loaded)

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        self._updates = None
        return super().load_state_dict(state_dict, *args, **kwargs)

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        averaged = self._tensors(self.module)
        current = [t.detach().to(a.device) for a, t in zip(averaged, self._tensors(model))]
        if self._updates is None:
            self._updates = int(self.n_averaged)  # the one read, after a load
        if self._updates == 0:
            torch._foreach_copy_(averaged, current)
        else:
            floating = [(a, c) for a, c in zip(averaged, current) if a.is_floating_point()]
            if floating:
                ours, theirs = (list(side) for side in zip(*floating))
                theirs = torch._foreach_mul(theirs, 1.0 - self.decay)  # as get_ema_avg_fn: decay * a + (1 - decay) * c
                torch._foreach_mul_(ours, self.decay)
                torch._foreach_add_(ours, theirs)
            for a, c in zip(averaged, current):
                if not a.is_floating_point():  # integer buffers, as torch: the float result copied in
                    a.copy_(self.decay * a + (1.0 - self.decay) * c)
        if not self.use_buffers:  # as torch: buffers not averaged follow the model's
            for ours, theirs in zip(self.module.buffers(), model.buffers()):
                ours.detach().copy_(theirs.detach().to(ours.device))
        self.n_averaged += 1
        self._updates += 1

    def _tensors(self, module: nn.Module) -> list[torch.Tensor]:
        tensors = itertools.chain(module.parameters(), module.buffers()) if self.use_buffers else module.parameters()
        return [t.detach() for t in tensors]


class EMA(EMAWeightAveraging):
    """Lightning's ``EMAWeightAveraging`` (same arguments, same behaviour and checkpoints) whose
    per-step update makes no host read (:class:`HostCountedEMAModel`)."""

    def __init__(self, device: Optional[Union[torch.device, str, int]] = None, use_buffers: bool = True,
                 decay: float = 0.999, update_every_n_steps: int = 1, update_starting_at_step: Optional[int] = None,
                 update_starting_at_epoch: Optional[int] = None) -> None:
        super().__init__(device=device, use_buffers=use_buffers, decay=decay,
                         update_every_n_steps=update_every_n_steps, update_starting_at_step=update_starting_at_step,
                         update_starting_at_epoch=update_starting_at_epoch)
        self.decay = float(decay)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return super().setup(trainer, pl_module, stage)
        if is_overridden("configure_model", pl_module):  # as Lightning's: the layers exist before the copy
            rank_zero_warn("EMA: the model overrides configure_model; the averaged copy is not sharded")
            pl_module.configure_model()
        self._average_model = HostCountedEMAModel(pl_module, self.decay, device=self._device or pl_module.device,
                                                  use_buffers=self._use_buffers)
