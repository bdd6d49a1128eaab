"""Tiny diffusion modules for the tests, from one flat set of settings: the U-ViT's (``image_size``
is its ``img_size``; ``num_classes`` when class-conditional) build the network the recipe is given,
the others are the recipe's. Unset, the U-ViT has the decayed shortcut (linear, alpha_min 0.7) and
zero-started branches of the paper's configs."""
from __future__ import annotations

from typing import Any

from lightning_mods.backbone.uvit import UViT
from lightning_mods.diffusion import DiffusionModule

NETWORK = {"image_size": "img_size", "in_chans": "in_chans", "patch_size": "patch_size", "embed_dim": "embed_dim",
           "depth": "depth", "num_heads": "num_heads", "mlp_ratio": "mlp_ratio", "qkv_bias": "qkv_bias",
           "mlp_time_embed": "mlp_time_embed", "final_conv": "final_conv", "shortcut": "shortcut",
           "zero_init_branches": "zero_init_branches"}
PAPER = {"shortcut": {"kind": "linear", "alpha_min": 0.7}, "zero_init_branches": True}


def uvit(**settings: Any) -> UViT:
    """The network of ``settings`` (the recipe's settings ignored)."""
    network = {NETWORK[k]: v for k, v in {**PAPER, **settings}.items() if k in NETWORK}
    if settings.get("class_conditional"):
        network["num_classes"] = settings.get("num_classes", 0)
    return UViT(**network)


def diffusion_module(cls: type = DiffusionModule, **settings: Any) -> DiffusionModule:
    """``cls`` (a DiffusionModule subclass) holding :func:`uvit` of ``settings``."""
    return cls(uvit(**settings), **{k: v for k, v in settings.items() if k not in NETWORK})
