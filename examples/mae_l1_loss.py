"""An MAE of one's own: an L1 loss on masked patches, against pixels or their horizontal
gradients (``docs``: extending shortcutlab, "A new MAE variant").

The network, ``MaskedAutoencoderViT``, names its extension points (its module docstring): the
masking (``mask_patches``), the reconstruction target (``reconstruction_target``, with
``target_to_pixels`` for the picture), the loss (``reconstruction_loss``) and the evaluation
features (``pool_features``). Override one in a subclass and give it to the recipe as its
network; everything else (kNN, probes, effective rank, checkpoints, resume) works unchanged.
With this file's folder on ``PYTHONPATH``::

    shortcutlab fit --config configs/digits_mae.yaml --model.network=mae_l1_loss.L1MaskedAutoencoderViT \\
        --model.network.target=gradients
"""
from __future__ import annotations

from typing import Any, Literal

import torch

from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.backbone.patches import patchify


class L1MaskedAutoencoderViT(MaskedAutoencoderViT):
    """Mean absolute error per patch, averaged over the masked patches.

    Args:
        target: ``pixels`` (as the base MAE, normalised per patch under ``norm_pix_loss``) or
            ``gradients``: the difference of horizontally neighbouring pixels, an edge map.
        **kwargs: the MaskedAutoencoderViT's.
    """

    def __init__(self, target: Literal["pixels", "gradients"] = "pixels", **kwargs: Any) -> None:
        if target not in ("pixels", "gradients"):
            raise ValueError(f"target must be 'pixels' or 'gradients', got {target!r}")
        super().__init__(**kwargs)
        self.target = target
        self.settings["target"] = target  # recorded, so a checkpoint rebuilds this very network

    def reconstruction_target(self, images: torch.Tensor) -> torch.Tensor:
        if self.target == "pixels":
            return super().reconstruction_target(images)
        gradients = torch.zeros_like(images)
        gradients[..., 1:] = images[..., 1:] - images[..., :-1]
        return patchify(gradients, self.patch_size)

    def target_to_pixels(self, pred: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        if self.target == "pixels":
            return super().target_to_pixels(pred, images)
        return pred  # the picture shows the predicted edge map

    def reconstruction_loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return ((pred - target).abs().mean(dim=-1) * mask).sum() / mask.sum().clamp_min(1.0)
