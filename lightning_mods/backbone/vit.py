"""Vision transformer with decayed identity shortcuts (the decay paper, section 3.1).

:class:`DecayedBlock` subclasses timm's pre-norm ``Block`` and only changes the two residual
sums; :class:`DecayedVisionTransformer` passes it to timm's ``VisionTransformer`` through
``block_fn``, so ``forward_features``, ``forward_intermediates`` and timm checkpoints keep
working. With ``ShortcutSchedule("none")`` (or ``alpha_min=1``) and ``zero_init_branches=False``
the network is timm's, number for number.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from timm.models.vision_transformer import Block, VisionTransformer

from .residual import DecayedResidual, apply_shortcut_schedule, residual_blocks
from .shortcut import ShortcutSchedule, check_depth, check_heads


class DecayedBlock(DecayedResidual, Block):
    """timm ``Block`` computing ``x <- a_k x + b_k f(x)`` for its attention and MLP sub-layers."""

    sublayer_types = ("attn", "mlp")
    alpha_names = ("alpha_attn", "alpha_mlp")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reset_shortcut()

    def attn_branch(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                    is_causal: bool = False) -> torch.Tensor:
        return self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)))

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        x = self.residual(0, x, self.attn_branch(x, attn_mask, is_causal))
        return self.residual(1, x, self.mlp_branch(x))

    @torch.no_grad()
    def zero_init_branches(self) -> None:
        """Zero the last linear layer of both branches (attention proj, MLP fc2)."""
        for layer in (self.attn.proj, self.mlp.fc2):
            nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def extra_repr(self) -> str:
        return self.shortcut_extra_repr()


def zero_init_residual_branches(model: nn.Module) -> None:
    """Call ``zero_init_branches`` on every shortcut-aware block that has it."""
    for blk in residual_blocks(model):
        if hasattr(blk, "zero_init_branches"):
            blk.zero_init_branches()


class DecayedVisionTransformer(VisionTransformer):
    """timm ``VisionTransformer`` whose blocks are :class:`DecayedBlock`.

    Args:
        shortcut: the schedule over the ``2 * depth`` residual sub-layers; ``None`` = standard.
        zero_init_branches: zero the last linear layer of every residual branch (the decay paper: needed
            for alpha_min <= 0.7).
        **kwargs: any ``timm.models.vision_transformer.VisionTransformer`` argument.
    """

    def __init__(self, shortcut: Optional[ShortcutSchedule] = None, zero_init_branches: bool = True,
                 **kwargs: Any) -> None:
        if "block_fn" in kwargs:
            raise ValueError("block_fn is fixed to DecayedBlock in DecayedVisionTransformer")
        check_depth(kwargs.get("depth", 12), "depth", " (number of transformer blocks)")
        check_heads(kwargs.get("embed_dim", 768), kwargs.get("num_heads", 12))
        super().__init__(block_fn=DecayedBlock, **kwargs)
        self.shortcut = ShortcutSchedule.coerce(shortcut)
        self.num_sublayers = apply_shortcut_schedule(self, self.shortcut)
        if zero_init_branches:
            zero_init_residual_branches(self)
