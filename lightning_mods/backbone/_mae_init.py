"""MAE's weight initialisation (He et al. 2022, ``facebookresearch/mae``; kept by the decay
paper's ``MAE/models_mae.py``).

Every ``nn.Linear`` weight is xavier-uniform and its bias zero (JAX ViT's choice), LayerNorms
start at weight 1 / bias 0, and the patch embedding's convolution is initialised like a
``Linear(C*p*p -> D)``: xavier-uniform on its flattened ``D x (C*p*p)`` view (its bias keeps
PyTorch's default, as in both repositories). Tokens are ``normal(0.02)``.

The decay paper's authors additionally start the last linear layer of every residual branch
(attention ``proj`` and MLP ``fc2`` of every transformer block, decoder included), of every
skip fusion and of the pixel prediction at zero weight: :func:`zero_branch_ends_`.
"""
from __future__ import annotations

from typing import Iterable

from torch import nn


def init_linear_and_norm_(module: nn.Module) -> None:
    """Xavier-uniform weights and zero biases for every ``nn.Linear``; unit LayerNorms."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm) and m.elementwise_affine:
            nn.init.ones_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def init_patch_embed_(proj: nn.Conv2d) -> None:
    """Xavier-uniform on the ``out x (in*kh*kw)`` view: fan_out = D, not D*p*p as for a conv."""
    nn.init.xavier_uniform_(proj.weight.data.view(proj.weight.shape[0], -1))


def zero_linear_(layer: nn.Linear) -> None:
    """Zero weight and bias."""
    nn.init.zeros_(layer.weight)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)


def zero_branch_ends_(blocks: Iterable[nn.Module]) -> None:
    """Zero ``attn.proj`` and ``mlp.fc2`` of timm-style pre-norm blocks (each branch starts at 0)."""
    for blk in blocks:
        zero_linear_(blk.attn.proj)
        zero_linear_(blk.mlp.fc2)
