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

from callbacks.cost import PER_STEP


class HostCountedEMAModel(AveragedModel):
    """``AveragedModel`` with an exponential moving average of ``decay`` whose update reads no
    tensor: the count of updates is kept on the host as well as in ``n_averaged``.

    The tensors it averages are listed once, at the first update after construction or a
    load (the model's ``Parameter`` and buffer objects themselves, so a later ``.to()`` of the
    model, which swaps their storage, is still seen), and an update is a handful of multi-tensor
    calls over those lists, whatever the number of tensors: the model's floating tensors copied
    into a scratch list kept from the first update, scaled by ``1 - decay``, the average scaled
    by ``decay`` and the two added (``get_ema_avg_fn``'s arithmetic, in its order). A model
    whose tensors are replaced by new objects after the first update needs :meth:`relist`.
    """

    def __init__(self, model: nn.Module, decay: float, device: Optional[Union[torch.device, str, int]] = None,
                 use_buffers: bool = False) -> None:
        super().__init__(model, device=device, use_buffers=use_buffers)
        self.decay = float(decay)
        self._updates: Optional[int] = 0  # None: not known on the host (a state was loaded)
        self._lists: Optional[_EMALists] = None

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        self._updates = None
        self.relist()
        return super().load_state_dict(state_dict, *args, **kwargs)

    def relist(self) -> None:
        """Forget the tensor lists: the next update lists the tensors anew."""
        self._lists = None

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        if self._lists is None or self._lists.model is not model:
            self._lists = _EMALists(self.module, model, self.use_buffers)
        lists = self._lists
        if self._updates is None:
            self._updates = int(self.n_averaged)  # the one read, after a load
        if self._updates == 0:
            torch._foreach_copy_(lists.averaged, lists.current)
        else:
            if lists.floating:
                torch._foreach_copy_(lists.scratch, lists.current_floating)
                torch._foreach_mul_(lists.scratch, 1.0 - self.decay)  # as get_ema_avg_fn: decay * a + (1 - decay) * c
                torch._foreach_mul_(lists.floating, self.decay)
                torch._foreach_add_(lists.floating, lists.scratch)
            for a, c in lists.integers:  # integer buffers, as torch: the float result copied in
                a.copy_(self.decay * a + (1.0 - self.decay) * c.to(a.device))
        if lists.followed:  # as torch: buffers not averaged follow the model's
            torch._foreach_copy_(lists.followed, lists.followed_model)
        self.n_averaged += 1
        self._updates += 1


class _EMALists:
    """The tensors one EMA update reads and writes, listed once (see :class:`HostCountedEMAModel`)."""

    def __init__(self, averaged_module: nn.Module, model: nn.Module, use_buffers: bool) -> None:
        def tensors(module: nn.Module) -> list[torch.Tensor]:
            return list(itertools.chain(module.parameters(), module.buffers()) if use_buffers else module.parameters())

        self.model = model
        self.averaged, self.current = tensors(averaged_module), tensors(model)
        pairs = list(zip(self.averaged, self.current))
        self.floating = [a for a, _ in pairs if a.is_floating_point()]
        self.current_floating = [c for a, c in pairs if a.is_floating_point()]
        self.scratch = [torch.empty_like(a) for a in self.floating]
        self.integers = [(a, c) for a, c in pairs if not a.is_floating_point()]
        self.followed = [] if use_buffers else list(averaged_module.buffers())
        self.followed_model = [] if use_buffers else list(model.buffers())


class EMA(EMAWeightAveraging):
    """Lightning's ``EMAWeightAveraging`` (same arguments, same behaviour and checkpoints) whose
    per-step update makes no host read (:class:`HostCountedEMAModel`)."""
    cost = PER_STEP

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
