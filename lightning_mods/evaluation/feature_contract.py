"""What the evaluation callbacks read a module through: the feature contract.

kNN, the online and offline linear probes, effective rank and the prediction writer accept any
``nn.Module`` (a LightningModule of one's own included) that implements :class:`FeatureModule`:

- ``num_features``: the width ``D`` of the evaluation features;
- ``forward_features(images) -> Tensor[B, D]``: the evaluation features;
- ``forward_intermediates(images, indices=None, intermediates_only=False)``, timm's call for
  block features: ``(features, [block features])``, or the block features alone with
  ``intermediates_only``. ``indices`` picks blocks as timm does (``None`` every block, an int
  ``n`` the last ``n``, a list of 0-based indices, negatives from the end). Each block feature
  is pooled, ``Tensor[B, D_k]`` (timm returns token maps; the evaluations read one vector a
  sample), in depth order; from one forward pass where the network allows.

A network whose ``forward_intermediates`` keeps timm's meaning (token maps, as
:class:`~lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT`) gives the pooled block
features as ``pooled_intermediates`` (same call), which the evaluations then read instead.

Only measurements over depth (``blocks=...``, ``EffectiveRank(per_block=True)``) need
``forward_intermediates``; a module without it gets a one-line error naming what is missing.
Every family of this package implements both.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence, Union, runtime_checkable

import torch

from lightning_mods._compat.library_private import feature_take_indices

Indices = Optional[Union[int, Sequence[int]]]


@runtime_checkable
class FeatureModule(Protocol):
    """A module the evaluation callbacks can measure (see the module docstring)."""

    num_features: int

    def forward_features(self, images: torch.Tensor) -> torch.Tensor: ...

    def forward_intermediates(self, images: torch.Tensor, indices: Indices = None,
                              intermediates_only: bool = False
                              ) -> Union[tuple[torch.Tensor, list[torch.Tensor]], list[torch.Tensor]]: ...


def take_indices(num_blocks: int, indices: Indices) -> list[int]:
    """timm's reading of ``indices`` over ``num_blocks`` blocks, as 0-based indices in depth order."""
    taken, _ = feature_take_indices(num_blocks, indices)
    return [int(i) for i in taken]


def require_features(module: object, owner: str) -> None:
    """One-line ``ValueError`` unless ``module`` has ``forward_features``."""
    if not callable(getattr(module, "forward_features", None)):
        raise ValueError(f"{owner} needs {type(module).__name__}.forward_features(images) -> B x D "
                         "(lightning_mods.evaluation.feature_contract.FeatureModule)")


def require_blocks(module: object, owner: str) -> None:
    """One-line ``ValueError`` unless ``module`` has ``forward_intermediates`` (block features)."""
    if not callable(getattr(module, "forward_intermediates", None)) and not callable(
            getattr(module, "pooled_intermediates", None)):
        raise ValueError(f"{owner} needs {type(module).__name__}.forward_intermediates(images, indices) for block "
                         "features (lightning_mods.evaluation.feature_contract.FeatureModule)")


def features_and_blocks(module: FeatureModule, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(features, every block's pooled features)`` from the module's ``forward_intermediates``."""
    features, blocks = pooled_call(module)(images)
    return features, list(blocks)


def block_features(module: FeatureModule, images: torch.Tensor, indices: Indices = None) -> list[torch.Tensor]:
    """The pooled features of the blocks ``indices`` picks (every block by default)."""
    return list(pooled_call(module)(images, indices, intermediates_only=True))


def pooled_call(module: FeatureModule):  # noqa: ANN201 (the bound method)
    """The module's ``pooled_intermediates`` where it has one, else its ``forward_intermediates``."""
    pooled = getattr(module, "pooled_intermediates", None)
    return pooled if callable(pooled) else module.forward_intermediates
