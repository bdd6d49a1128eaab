"""Independent references of the two published MAE models, written for the tests from the
papers' descriptions and timm's own ``Block`` / ``PatchEmbed`` (never from lightning_mods).

Their ``state_dict`` keys and shapes are those of the two repositories, so they double as
"foreign checkpoints" for the converter tests:

- :class:`AuthorsMAE`: the decay paper's ``MAE/models_mae.py`` (xiao7199/decayed_Identity_shortcuts):
  decayed encoder blocks ``x <- a x + f(x)`` with ``a = 1 - linspace(0, 1, 2*depth) * (1 - min_decay)``,
  no final encoder norm; decoder stream = ``decoder_embed([decoder_cls_token, decoder_pos_embed[1:]])``;
  before decoder block ``i``, ``skip[i]`` (one ``SkipLayer`` per pair of encoder blocks, each with its own
  ``mask_token``) fuses the output of encoder block ``depth - 1 - 2 i``:
  ``x + fc([unshuffled skip, x])`` with ``fc = Linear, SiLU, Linear``.
- :class:`OfficialMAE`: He et al.'s ``models_mae.py`` (facebookresearch/mae), with the same
  optional decay (1.0 = the official model): final encoder ``norm``, ``decoder_embed(enc -> dec)``,
  ``mask_token``, ``decoder_pos_embed`` added to every token.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch
from torch import nn
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block

LN6 = partial(nn.LayerNorm, eps=1e-6)


def sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """MAE's ``get_2d_sincos_pos_embed(dim, grid, cls_token=True)`` in float64 numpy -> float32."""
    def one_d(d: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    gw, gh = np.meshgrid(np.arange(grid, dtype=np.float64), np.arange(grid, dtype=np.float64))  # w first
    emb = np.concatenate([one_d(dim // 2, gw), one_d(dim // 2, gh)], axis=1)
    return torch.from_numpy(np.concatenate([np.zeros((1, dim)), emb], axis=0)).float().unsqueeze(0)


def decays(depth: int, min_decay: float) -> np.ndarray:
    return 1 - np.linspace(0, 1, 2 * depth).reshape(-1, 2) * (1 - min_decay)


def run_decayed(blk: Block, x: torch.Tensor, decay: np.ndarray) -> torch.Tensor:
    x = float(decay[0]) * x + blk.attn(blk.norm1(x))
    return float(decay[1]) * x + blk.mlp(blk.norm2(x))


def mask_by_noise(x: torch.Tensor, noise: torch.Tensor, mask_ratio: float):
    n, length, d = x.shape
    len_keep = int(length * (1 - mask_ratio))
    ids_shuffle = torch.argsort(noise, dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    kept = torch.gather(x, 1, ids_shuffle[:, :len_keep].unsqueeze(-1).repeat(1, 1, d))
    mask = torch.ones(n, length)
    mask[:, :len_keep] = 0
    return kept, torch.gather(mask, 1, ids_restore), ids_restore


def in_order(n: int, length: int) -> torch.Tensor:
    """Noise that keeps every patch in its own place (mask ratio 0: evaluation)."""
    return torch.arange(length, dtype=torch.float32).expand(n, length)


def unshuffle(visible: torch.Tensor, mask_token: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
    """``visible``: cls + kept tokens; returns cls + all patches in order, mask_token where masked."""
    fill = mask_token.repeat(visible.shape[0], ids_restore.shape[1] + 1 - visible.shape[1], 1)
    rest = torch.cat([visible[:, 1:], fill], dim=1)
    rest = torch.gather(rest, 1, ids_restore.unsqueeze(-1).repeat(1, 1, visible.shape[2]))
    return torch.cat([visible[:, :1], rest], dim=1)


def mae_loss(imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor, p: int, norm_pix: bool) -> torch.Tensor:
    n, c, h, _ = imgs.shape
    g = h // p
    target = torch.einsum("nchpwq->nhwpqc", imgs.reshape(n, c, g, p, g, p)).reshape(n, g * g, p * p * c)
    if norm_pix:
        target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
    return (((pred - target) ** 2).mean(-1) * mask).sum() / mask.sum()


class _Encoder(nn.Module):
    def __init__(self, img_size, patch_size, in_chans, embed_dim, depth, num_heads, mlp_ratio, min_decay):
        super().__init__()
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(sincos_2d(embed_dim, img_size // patch_size), requires_grad=False)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=LN6)
                                    for _ in range(depth))
        self.decay = decays(depth, min_decay)
        self.patch_size = patch_size

    def _decoder_blocks(self, img_size, patch_size, in_chans, decoder_embed_dim, decoder_depth, decoder_num_heads,
                        mlp_ratio, norm_pix_loss):
        """What both repositories' decoders share: fixed positions, the blocks, the norm, the pixel head."""
        self.decoder_pos_embed = nn.Parameter(sincos_2d(decoder_embed_dim, img_size // patch_size),
                                              requires_grad=False)
        self.decoder_blocks = nn.ModuleList(
            Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True, norm_layer=LN6)
            for _ in range(decoder_depth))
        self.decoder_norm = LN6(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size ** 2 * in_chans)
        self.norm_pix_loss = norm_pix_loss

    def encode(self, imgs, noise, mask_ratio):
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:]
        x, mask, ids_restore = mask_by_noise(x, noise, mask_ratio)
        x = torch.cat([(self.cls_token + self.pos_embed[:, :1]).expand(x.shape[0], -1, -1), x], dim=1)
        outputs = []
        for blk, decay in zip(self.blocks, self.decay):
            x = run_decayed(blk, x, decay)
            outputs.append(x)
        return outputs, mask, ids_restore


class SkipLayer(nn.Module):
    def __init__(self, feat_dim: int, skip_dim: int) -> None:
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(skip_dim + feat_dim, feat_dim), nn.SiLU(), nn.Linear(feat_dim, feat_dim))
        self.mask_token = nn.Parameter(torch.randn(1, 1, skip_dim) * 0.02)

    def forward(self, stream, skip_tokens, ids_restore):
        skip = unshuffle(skip_tokens, self.mask_token, ids_restore)
        return stream + self.fc(torch.cat([skip, stream], dim=-1))


class AuthorsMAE(_Encoder):
    def __init__(self, img_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=4, num_heads=4,
                 decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2, mlp_ratio=4.0, norm_pix_loss=True,
                 min_decay=1.0):
        super().__init__(img_size, patch_size, in_chans, embed_dim, depth, num_heads, mlp_ratio, min_decay)
        self.skip = nn.ModuleList(SkipLayer(decoder_embed_dim, embed_dim) for _ in range(depth // 2))
        self.decoder_cls_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.decoder_embed = nn.Linear(decoder_embed_dim, decoder_embed_dim)
        self._decoder_blocks(img_size, patch_size, in_chans, decoder_embed_dim, decoder_depth, decoder_num_heads,
                             mlp_ratio, norm_pix_loss)

    def forward(self, imgs, noise, mask_ratio=0.75):
        outputs, mask, ids_restore = self.encode(imgs, noise, mask_ratio)
        skips = outputs[1::2]
        start = torch.cat([self.decoder_cls_token, self.decoder_pos_embed[:, 1:]], dim=1)
        x = self.decoder_embed(start.expand(imgs.shape[0], -1, -1))
        for i, blk in enumerate(self.decoder_blocks):
            if skips:
                x = self.skip[i](x, skips.pop(), ids_restore)
            x = blk(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:]
        return mae_loss(imgs, pred, mask, self.patch_size, self.norm_pix_loss), pred, mask

    def features(self, imgs):
        """Mean over all tokens of the last block (the authors' ``forward_feat`` + mean)."""
        return self.encode(imgs, in_order(imgs.shape[0], self.num_patches), 0.0)[0][-1].mean(1)


class OfficialMAE(_Encoder):
    def __init__(self, img_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=4, num_heads=4,
                 decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2, mlp_ratio=4.0, norm_pix_loss=True,
                 min_decay=1.0):
        super().__init__(img_size, patch_size, in_chans, embed_dim, depth, num_heads, mlp_ratio, min_decay)
        self.norm = LN6(embed_dim)
        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self._decoder_blocks(img_size, patch_size, in_chans, decoder_embed_dim, decoder_depth, decoder_num_heads,
                             mlp_ratio, norm_pix_loss)

    def forward(self, imgs, noise, mask_ratio=0.75):
        outputs, mask, ids_restore = self.encode(imgs, noise, mask_ratio)
        x = self.decoder_embed(self.norm(outputs[-1]))
        x = unshuffle(x, self.mask_token, ids_restore) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:]
        return mae_loss(imgs, pred, mask, self.patch_size, self.norm_pix_loss), pred, mask

    def features(self, imgs):
        """Mean over all tokens of the normed encoder output."""
        return self.norm(self.encode(imgs, in_order(imgs.shape[0], self.num_patches), 0.0)[0][-1]).mean(1)


@torch.no_grad()
def randomise_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every trainable tensor random (nothing left at a zero start); fixed position embeddings kept."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or "norm.weight" in name:
            p.copy_(1 + 0.1 * noise)
        elif p.dim() >= 2 and "token" not in name:
            p.copy_(noise / p[0].numel() ** 0.5)
        else:
            p.copy_(0.1 * noise)
    return model
