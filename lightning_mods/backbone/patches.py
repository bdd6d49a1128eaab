"""Patch utilities of the masked autoencoder (the decay paper, section 4; He et al. 2022, section 3):
fixed 2-D sin-cos position embeddings, patchify/unpatchify and per-sample random masking."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def sincos_pos_embed_2d(embed_dim: int, grid_size: int, cls_token: bool = False) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding, ``(grid_size**2 [+1]) x embed_dim`` (MAE's recipe).

    Half of the channels encode the row, half the column; each half is
    ``[sin(pos * omega), cos(pos * omega)]`` with ``omega_i = 10000 ** (-i / (D/4))``.
    A class token, when asked for, gets the all-zero embedding in row 0.

    Kept rather than timm's ``build_sincos2d_pos_embed``: that one orders the channels
    ``[sin(row), sin(col), cos(row), cos(col)]`` (a permutation of MAE's ``[sin(col), cos(col),
    sin(row), cos(row)]``) and computes frequencies and angles in float32, so after the
    permutation it still differs from MAE's float64 table in the last bits of ~40 % of the
    entries (up to 8e-7 at 768 x 14 x 14); converted MAE checkpoints need the table bit for bit.
    """
    if embed_dim % 4 != 0:
        raise ValueError(f"embed_dim must be divisible by 4 for a 2-D sin-cos embedding, got {embed_dim}")
    omega = 1.0 / 10000 ** (np.arange(embed_dim // 4, dtype=np.float64) / (embed_dim / 4.0))
    rows, cols = np.meshgrid(np.arange(grid_size, dtype=np.float64), np.arange(grid_size, dtype=np.float64),
                             indexing="ij")

    def encode(pos: np.ndarray) -> np.ndarray:
        angles = np.outer(pos.reshape(-1), omega)
        return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)

    # MAE puts the width (column) coordinate first
    emb = np.concatenate([encode(cols), encode(rows)], axis=1)
    if cls_token:
        emb = np.concatenate([np.zeros((1, embed_dim)), emb], axis=0)
    return torch.from_numpy(emb).float()


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``B x C x H x W`` -> ``B x L x (p*p*C)``, patches in row-major order, pixels (p, p, C)."""
    b, c, h, w = images.shape
    if h % patch_size or w % patch_size:
        raise ValueError(f"image size {h}x{w} is not divisible by patch_size={patch_size}")
    gh, gw = h // patch_size, w // patch_size
    x = images.reshape(b, c, gh, patch_size, gw, patch_size)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(b, gh * gw, patch_size * patch_size * c)


def unpatchify(patches: torch.Tensor, patch_size: int, channels: int) -> torch.Tensor:
    """Inverse of :func:`patchify` for square images."""
    b, length, _ = patches.shape
    g = int(round(length ** 0.5))
    if g * g != length:
        raise ValueError(f"unpatchify needs a square grid of patches, got {length}")
    x = patches.reshape(b, g, g, patch_size, patch_size, channels)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(b, channels, g * patch_size, g * patch_size)


def num_kept(num_patches: int, mask_ratio: float) -> int:
    """Visible patches per sample: ``int(L * (1 - mask_ratio))`` as both MAE codes (196 patches
    at 0.9 keep 19); a ratio that leaves none is a one-line ValueError."""
    keep = int(num_patches * (1 - mask_ratio))
    if keep < 1:
        raise ValueError(f"mask_ratio {mask_ratio} leaves no visible patch of {num_patches} "
                         f"(int(L * (1 - mask_ratio)) = 0); lower it")
    return keep


def random_masking(
    tokens: torch.Tensor, mask_ratio: float, generator: torch.Generator | Sequence[torch.Generator] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep a random subset of tokens per sample (argsort of uniform noise). ``generator``: one
    for the batch, or one per sample (each sample's noise drawn from its own), or None (the
    global RNG).

    Returns ``(visible tokens B x K x D, mask B x L with 1 = masked, ids_restore B x L,
    ids_keep B x K)``; ``K = int(L * (1 - mask_ratio))``.
    """
    b, length, d = tokens.shape
    keep = num_kept(length, mask_ratio)
    if isinstance(generator, Sequence):
        noise = torch.cat([torch.rand(1, length, device=tokens.device, generator=g) for g in generator])
    else:
        noise = torch.rand(b, length, device=tokens.device, generator=generator)
    ids_shuffle = torch.argsort(noise, dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :keep]
    visible = torch.gather(tokens, 1, ids_keep.unsqueeze(-1).expand(-1, -1, d))
    mask = torch.ones(b, length, device=tokens.device)
    mask[:, :keep] = 0
    mask = torch.gather(mask, 1, ids_restore)
    return visible, mask, ids_restore, ids_keep


def restore_order(visible: torch.Tensor, ids_restore: torch.Tensor, mask_token: torch.Tensor) -> torch.Tensor:
    """Put visible tokens ``B x K x D`` back in patch order with ``mask_token`` elsewhere -> ``B x L x D``."""
    b, keep, d = visible.shape
    length = ids_restore.shape[1]
    fill = mask_token.to(visible.dtype).expand(b, length - keep, d)
    full = torch.cat([visible, fill], dim=1)
    return torch.gather(full, 1, ids_restore.unsqueeze(-1).expand(-1, -1, d))
