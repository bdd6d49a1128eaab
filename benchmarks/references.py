"""Reference networks written from timm's stock ``Block`` for the side-by-side figures: what a
user would otherwise run.

- :class:`PlainUViT`: the U-ViT of Bao et al. (2023), published layout: time token (and class
  token) prepended to the patch tokens, ``depth // 2`` in-blocks, a mid block, ``depth // 2``
  out-blocks each preceded by ``Linear(2D -> D)`` over ``[x, skip]`` (long skips, last in first
  out), final LayerNorm, linear patch decoder and a 3x3 output conv.
- :class:`ReferenceMAE`: He et al. (2022)'s MAE: encoder on the visible 25 % of patches (per-
  sample random shuffle), final LayerNorm, linear decoder embed, mask tokens, fixed 2-D sin-cos
  position embeddings in encoder and decoder, decoder blocks, MSE on masked (normalised) patches.
"""
from __future__ import annotations

import math
from functools import partial

import torch
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block
from torch import nn

from lightning_mods.backbone.patches import sincos_pos_embed_2d


class PlainUViT(nn.Module):
    """Bao et al.'s U-ViT from stock timm blocks (noise prediction at timestep ``t``)."""

    def __init__(self, img_size: int = 32, patch_size: int = 2, in_chans: int = 3, embed_dim: int = 512,
                 depth: int = 12, num_heads: int = 8, mlp_ratio: float = 4.0, qkv_bias: bool = False) -> None:
        super().__init__()
        self.patch_size, self.in_chans, self.embed_dim = patch_size, in_chans, embed_dim
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.patch_embed.num_patches, embed_dim))

        def block() -> Block:
            return Block(embed_dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias)

        self.in_blocks = nn.ModuleList([block() for _ in range(depth // 2)])
        self.mid_block = block()
        self.out_blocks = nn.ModuleList([block() for _ in range(depth // 2)])
        self.skip_linears = nn.ModuleList([nn.Linear(2 * embed_dim, embed_dim) for _ in range(depth // 2)])
        self.norm = nn.LayerNorm(embed_dim)
        self.decoder_pred = nn.Linear(embed_dim, patch_size ** 2 * in_chans)
        self.final_layer = nn.Conv2d(in_chans, in_chans, 3, padding=1)

    def time_token(self, t: torch.Tensor) -> torch.Tensor:
        half = self.embed_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).unsqueeze(1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        tokens = torch.cat([self.time_token(t), self.patch_embed(x)], dim=1) + self.pos_embed
        skips = []
        for blk in self.in_blocks:
            tokens = blk(tokens)
            skips.append(tokens)
        tokens = self.mid_block(tokens)
        for fuse, blk in zip(self.skip_linears, self.out_blocks):
            tokens = blk(fuse(torch.cat([tokens, skips.pop()], dim=-1)))
        patches = self.decoder_pred(self.norm(tokens))[:, 1:]
        p, c = self.patch_size, self.in_chans
        image = patches.reshape(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
        return self.final_layer(image)


class ReferenceMAE(nn.Module):
    """He et al.'s masked autoencoder from stock timm blocks; ``forward(images) -> loss``."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768,
                 depth: int = 12, num_heads: int = 12, decoder_embed_dim: int = 512, decoder_depth: int = 8,
                 decoder_num_heads: int = 16, mlp_ratio: float = 4.0, mask_ratio: float = 0.75,
                 norm_pix_loss: bool = True) -> None:
        super().__init__()
        norm = partial(nn.LayerNorm, eps=1e-6)  # the authors' norm layer
        self.patch_size, self.mask_ratio, self.norm_pix_loss = patch_size, mask_ratio, norm_pix_loss
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        grid = img_size // patch_size
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.register_buffer("pos_embed", sincos_pos_embed_2d(embed_dim, grid, cls_token=True).unsqueeze(0))
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm)
                                     for _ in range(depth)])
        self.norm = norm(embed_dim)
        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        self.register_buffer("decoder_pos_embed", sincos_pos_embed_2d(decoder_embed_dim, grid, cls_token=True).unsqueeze(0))
        self.decoder_blocks = nn.ModuleList([Block(decoder_embed_dim, decoder_num_heads, mlp_ratio, qkv_bias=True,
                                                   norm_layer=norm) for _ in range(decoder_depth)])
        self.decoder_norm = norm(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size ** 2 * in_chans)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)

    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        b, c, h, w = images.shape
        x = images.reshape(b, c, h // p, p, w // p, p)
        return torch.einsum("nchpwq->nhwpqc", x).reshape(b, (h // p) * (w // p), p * p * c)

    def random_masking(self, x: torch.Tensor):
        b, length, dim = x.shape
        keep = int(length * (1 - self.mask_ratio))
        ids_shuffle = torch.argsort(torch.rand(b, length, device=x.device), dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        visible = torch.gather(x, 1, ids_shuffle[:, :keep, None].expand(-1, -1, dim))
        mask = torch.ones(b, length, device=x.device)
        mask[:, :keep] = 0
        return visible, torch.gather(mask, 1, ids_restore), ids_restore

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images) + self.pos_embed[:, 1:]
        x, mask, ids_restore = self.random_masking(x)
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.decoder_embed(self.norm(x))
        masked = self.mask_token.expand(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], -1)
        x_ = torch.cat([x[:, 1:], masked], dim=1)
        x_ = torch.gather(x_, 1, ids_restore[:, :, None].expand(-1, -1, x.shape[2]))
        x = torch.cat([x[:, :1], x_], dim=1) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:]
        target = self.patchify(images)
        if self.norm_pix_loss:
            mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
            target = (target - mean) / (var + 1e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(dim=-1)
        return (loss * mask).sum() / mask.sum()
