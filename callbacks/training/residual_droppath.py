"""ResidualDroppath as a callback (the ResidualDroppath paper, section 3; "ResidualDroppath: Enhancing Feature Reuse
over Residual Connections", section 3.2 and Algorithm 1).

Training iterations alternate, by the parity of ``trainer.global_step`` (one iteration = one
optimiser step; every micro-batch of a gradient-accumulation step has the same parity, and the
parity is right after a resume because the global step is restored):

- even step ("drop"): every residual sub-layer draws a per-sample keep mask ``m`` (drop rate
  ``p``) and computes ``x <- a x + b f(x) * m``, without the usual ``1 / (1 - p)`` rescaling;
- odd step ("reuse"): the masks of the previous step again, as
  ``x <- a x + b (f(x).detach() * m + f(x) * (1 - m))``: the forward value is the plain
  network's, but gradient reaches a branch (its parameters and, through it, its input) only
  from the samples where it was dropped the step before. This is exact per sample for branches
  without cross-sample operations; a ResNet branch's train-mode batch norm mixes the batch
  through its statistics, so there the kept samples still reach the gradient through the batch
  mean and variance (as in the paper's ResNet experiments, which use the same formula).

The masks act through ``branch_hook`` of every :class:`~lightning_mods.backbone.residual.DecayedResidual`
block (ResNet blocks: one sub-layer each; ViT blocks: attention and MLP separately), so the
LightningModule knows nothing about it. The hooks exist only from ``on_train_batch_start`` to
``on_train_batch_end`` of a training batch: validation, test, predict and sanity checks run
the plain network, and nothing is left installed after ``fit``. Within a training batch, a
block in eval mode (another callback's extra forward, such as an online probe) is left plain.

Masks and batches:

- a mask is drawn once per (micro-batch, sub-layer), the first time the sub-layer runs in that
  micro-batch (a second call in the same micro-batch, e.g. activation-checkpointing
  recomputation, reuses it); the odd step's micro-batch ``i`` reuses the even step's
  micro-batch ``i`` masks;
- a batch of another size (the last batch of an epoch) slices a longer stored mask; where the
  odd step has more samples (or micro-batches) than the even step drew, the missing keep bits
  are drawn fresh at the same rate, and kept for the rest of that micro-batch only;
- an odd step without masks from the step just before it (the first step of a run started at
  an odd step, a checkpoint without this callback's state) draws fresh masks.

Randomness: the draws use a CPU generator seeded from ``(seed, global rank, global step,
micro-batch)``: independent masks per DDP rank, reproducible, and not taken from the global
RNG. ``seed`` defaults to rank 0's ``torch.initial_seed()`` (set by ``seed_everything``), sent to
every rank at the start of training. The callback's
``state_dict`` holds the masks in flight (rank 0's, the rank that writes checkpoints) and the
seed; after a resume every other rank replays its own draws from the seed, so the ranks keep
distinct masks.

DDP cannot hang on a block that gets no gradient on one rank: the masked branch stays in the
autograd graph on both kinds of step (``f * m`` with ``m`` all zeros, ``f * (1 - m)`` with
``m`` all ones), so its parameters receive a gradient of zeros, not no gradient, and the
reducer's buckets fill on every rank. ``find_unused_parameters`` can stay off (Lightning's
default). Returning ``f.detach()`` for an all-kept block instead would leave its parameters
out of the graph on that rank: DDP then stops with its unused-parameters error or waits for
the other ranks (tests/callbacks/test_residual_droppath.py runs one sample per rank under DDP).
"""
from __future__ import annotations

from typing import Any, Literal, Optional

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from timm.layers import DropPath

from lightning_mods.backbone.residual import DecayedResidual, residual_blocks
from callbacks.cost import PER_STEP

Phase = Literal["drop", "reuse"]


def phase_of_step(global_step: int) -> Phase:
    """``drop`` on even optimiser steps, ``reuse`` on odd ones."""
    return "drop" if global_step % 2 == 0 else "reuse"


def draw_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from non-negative integers (numpy's ``SeedSequence``)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


def broadcast_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``B`` keep bits -> ``B x 1 x ... x 1`` in ``like``'s dtype."""
    return mask.view(-1, *([1] * (like.ndim - 1))).to(like.dtype)


class ResidualDroppath(Callback):
    """Alternate droppath steps and steps that train only the dropped paths (see module docstring).

    Args:
        drop_rate: probability that a sub-layer's branch is dropped for a sample (paper: 0.1).
        seed: base seed of the mask draws; ``None`` uses rank 0's ``torch.initial_seed()`` at the
            start of training.
    """
    cost = PER_STEP

    def __init__(self, drop_rate: float = 0.1, seed: Optional[int] = None) -> None:
        super().__init__()
        if not 0.0 <= float(drop_rate) < 1.0:
            raise ValueError(f"ResidualDroppath: drop_rate must be in [0, 1), got {drop_rate!r}")
        if seed is not None and int(seed) < 0:
            raise ValueError(f"ResidualDroppath: seed must be a non-negative integer or None, got {seed!r}")
        self.drop_rate = float(drop_rate)
        self.seed = seed
        self._seed: Optional[int] = None
        self._blocks: list[DecayedResidual] = []
        self._block_index: dict[int, int] = {}
        # masks drawn at optimiser step ``_masks_step``: one {"block.sublayer": keep bits} per micro-batch
        self._masks: list[dict[str, torch.Tensor]] = []
        self._masks_step: Optional[int] = None
        self._replay_for_rank = False  # loaded from a checkpoint: ranks other than 0 redraw theirs
        self._step: Optional[int] = None
        self._micro = 0
        self._in_use: dict[str, torch.Tensor] = {}
        self._generator: Optional[torch.Generator] = None
        self.phase: Optional[Phase] = None  # of the training batch in progress, None outside one

    # --- public views ---------------------------------------------------------------------
    @property
    def masks(self) -> list[dict[str, torch.Tensor]]:
        """Keep bits drawn at the last drop step, per micro-batch, keyed ``"<block>.<sub-layer>"``."""
        return self._masks

    @property
    def current_masks(self) -> dict[str, torch.Tensor]:
        """Keep bits of the training batch in progress (fresh extensions included); a batch of
        ``B`` samples uses the first ``B`` of each."""
        return self._in_use

    @property
    def masks_step(self) -> Optional[int]:
        """The optimiser step the stored masks were drawn at."""
        return self._masks_step

    # --- set-up ---------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._blocks = residual_blocks(pl_module)
        if not self._blocks:
            raise ValueError(f"ResidualDroppath: {type(pl_module).__name__} has no DecayedResidual blocks "
                             "(lightning_mods.backbone.residual) to drop")
        self._block_index = {id(blk): i for i, blk in enumerate(self._blocks)}
        if any(isinstance(m, DropPath) for m in pl_module.modules()):
            rank_zero_warn("ResidualDroppath: the model also has timm DropPath layers (drop_path_rate > 0); "
                           "their rescaled drops act inside the branches ResidualDroppath masks")

    # --- training batches -----------------------------------------------------------------
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._step, self._micro = None, 0
        if self._seed is None:  # not restored from a checkpoint
            # without seed_everything every process has its own initial seed; rank 0's is the one
            # a checkpoint keeps, so it must be the one every rank draws (and later replays) from
            self._seed = int(trainer.strategy.broadcast(self._own_seed(), src=0))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = int(trainer.global_step)
        self._micro = self._micro + 1 if step == self._step else 0
        self._step = step
        if self._seed is None:  # driven without on_train_start (by hand, in tests): this process's seed
            self._seed = self._own_seed()
        rank = int(trainer.global_rank)
        if self._replay_for_rank:
            self._replay_for_rank = False
            if rank != 0:
                self._masks = self._replay(self._masks, rank)
        self.phase = phase_of_step(step)
        if self.phase == "drop":
            if self._micro == 0:
                self._masks, self._masks_step = [], step
            self._in_use = {}
            self._masks.append(self._in_use)  # draws of this micro-batch are stored
        else:
            fresh = self._masks_step != step - 1 or self._micro >= len(self._masks)
            self._in_use = {} if fresh else dict(self._masks[self._micro])  # extensions stay local
        self._generator = torch.Generator().manual_seed(draw_seed(self._seed, rank, step, self._micro))
        self._install()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._remove()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._remove()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._remove()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._remove()

    def _own_seed(self) -> int:
        return int(self.seed) if self.seed is not None else int(torch.initial_seed())

    def _install(self) -> None:
        for blk in self._blocks:
            if blk.branch_hook is not None and blk.branch_hook != self._branch_hook:
                raise RuntimeError(f"ResidualDroppath: block {self._block_index[id(blk)]} already has another "
                                   "branch_hook")
            blk.branch_hook = self._branch_hook

    def _remove(self) -> None:
        for blk in self._blocks:
            if blk.branch_hook == self._branch_hook:
                blk.branch_hook = None
        self.phase = None

    # --- masks ----------------------------------------------------------------------------
    def _draw(self, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self._generator) >= self.drop_rate

    def _mask(self, key: str, batch: int, device: torch.device) -> torch.Tensor:
        mask = self._in_use.get(key)
        if mask is None or mask.shape[0] < batch:
            have = 0 if mask is None else mask.shape[0]
            extra = self._draw(batch - have).to(device)
            mask = extra if mask is None else torch.cat([mask.to(device), extra])
            self._in_use[key] = mask
        elif mask.device != device:
            mask = mask.to(device)
            self._in_use[key] = mask
        return mask[:batch]

    def _branch_hook(self, block: DecayedResidual, j: int, branch: torch.Tensor) -> torch.Tensor:
        if not block.training:  # an eval-mode forward inside a training batch (e.g. an online probe)
            return branch
        key = f"{self._block_index[id(block)]}.{j}"
        m = broadcast_mask(self._mask(key, branch.shape[0], branch.device), branch)
        if self.phase == "drop":
            return branch * m
        return branch.detach() * m + branch * (1 - m)

    def _replay(self, masks: list[dict[str, torch.Tensor]], rank: int) -> list[dict[str, torch.Tensor]]:
        """This rank's draws of step ``_masks_step``: same keys, order and sizes as rank 0's."""
        replayed = []
        for micro, drawn in enumerate(masks):
            gen = torch.Generator().manual_seed(draw_seed(self._seed, rank, self._masks_step, micro))
            replayed.append({key: torch.rand(len(bits), generator=gen) >= self.drop_rate
                             for key, bits in drawn.items()})
        return replayed

    # --- checkpoint -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"drop_rate": self.drop_rate, "seed": self._seed, "masks_step": self._masks_step,
                "masks": [{key: bits.detach().cpu() for key, bits in drawn.items()} for drawn in self._masks]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._seed = state_dict.get("seed", self._seed)
        self._masks_step = state_dict.get("masks_step")
        self._masks = [dict(drawn) for drawn in state_dict.get("masks", [])]
        self._replay_for_rank = bool(self._masks) and self._seed is not None and self._masks_step is not None
        if state_dict.get("drop_rate", self.drop_rate) != self.drop_rate:
            rank_zero_warn(f"ResidualDroppath: resuming with drop_rate={self.drop_rate} over masks drawn at "
                           f"drop_rate={state_dict['drop_rate']}")
