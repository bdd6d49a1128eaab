"""The patch-feature picture (the decay paper's Figure 3; the PCA view of DINO's figures): what a
block's pixel-wise embeddings look like.

For a fixed set of images, the patch tokens of one block (the last by default; for a ResNet the
spatial map of a residual block) of all images are pooled into one ``M x D`` matrix, centred,
and projected on its top three principal components, computed jointly over the set
(:func:`principal_components`, an SVD in float64). Each component is min-max scaled to [0, 1]
over the set and the three are drawn as RGB at patch resolution, upsampled to the image size
(nearest neighbour: a patch stays a square), next to the input (:func:`patch_feature_figure`).
The same colour in two images means a similar embedding.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from lightning_mods.pictures.grids import labelled_grid

COMPONENTS = 3


def principal_components(tokens: torch.Tensor, count: int = COMPONENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(components count x D, projections M x count)`` of the centred rows of ``tokens``
    (``M x D``), float64, components in order of decreasing variance (signs as the SVD gives
    them). Fewer than ``count`` dimensions: the missing projections are 0."""
    if tokens.ndim != 2 or tokens.shape[0] < 2:
        raise ValueError(f"principal_components: tokens must be M x D with M >= 2, got {tuple(tokens.shape)}")
    x = tokens.double()
    centred = x - x.mean(dim=0, keepdim=True)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)
    components = vh[:count]
    projections = centred @ components.T
    if projections.shape[1] < count:
        projections = torch.cat([projections, projections.new_zeros(len(projections), count - projections.shape[1])], 1)
    return components, projections


def patch_rgb(patch_features: torch.Tensor) -> torch.Tensor:
    """``N x h x w x D`` patch features -> ``N x h x w x 3`` colours in [0, 1]: the top three
    principal components over all ``N * h * w`` patches, each min-max scaled over the set."""
    if patch_features.ndim != 4:
        raise ValueError(f"patch_rgb: patch features must be N x h x w x D, got {tuple(patch_features.shape)}")
    n, h, w, d = patch_features.shape
    _, projections = principal_components(patch_features.reshape(n * h * w, d))
    low, high = projections.min(dim=0).values, projections.max(dim=0).values
    scaled = (projections - low) / (high - low).clamp_min(1e-12)
    return scaled.reshape(n, h, w, COMPONENTS).float()


def upsample(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """``N x h x w x 3`` -> ``N x height x width x 3``, each patch a block of equal pixels
    (``height`` and ``width`` multiples of ``h`` and ``w``; else nearest neighbour)."""
    n, h, w, _ = rgb.shape
    rows = (np.arange(height) * h) // height
    cols = (np.arange(width) * w) // width
    return rgb[:, rows][:, :, cols]


def patch_feature_figure(images: np.ndarray, rgb: np.ndarray, title: str,
                         image_labels: Optional[Sequence[str]] = None):
    """One column per image: the input (``N x H x W x C`` in [0, 1]) above its patch colours
    (``N x h x w x 3``, upsampled to ``H x W``). A matplotlib ``Figure``."""
    images = np.asarray(images, dtype=np.float32)
    if images.shape[-1] == 1:
        images = np.repeat(images, 3, axis=-1)
    colours = upsample(np.asarray(rgb, dtype=np.float32), images.shape[1], images.shape[2])
    tiles = np.stack([images[..., :3], colours], axis=0)
    return labelled_grid(tiles, title, row_labels=["input", "patch PCA"],
                         col_labels=image_labels or [str(i) for i in range(len(images))])


def images_for_display(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """``N x C x H x W`` model inputs -> ``N x H x W x C`` in [0, 1] (the normalisation undone)."""
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (images.detach().float().cpu() * s + m).clamp(0, 1).permute(0, 2, 3, 1).numpy()
