"""MAE decoders (the decay paper, section 4): the U-Net-skip decoder of the decay paper and, for its
ablation, He et al.'s classic MAE decoder fed with the encoder's last output.

U-Net-skip decoder (authors' ``MAE/models_mae.py``). The decoder stream does not start from the
encoder output: it starts from a learned decoder-width cls token and the decoder-width fixed
sin-cos position embeddings of every patch (the cls row of the embedding is not added to the
cls token), through ``Linear(dec -> dec)``. Skips come from every other encoder block (0-indexed
blocks 1, 3, 5, ...), the deepest entering the first decoder block. Before a decoder block
with a skip, its fusion puts the encoder tokens of that block (visible patches) back in patch
order with its OWN learned mask token (encoder width) at masked positions, concatenates
``[skip, stream]`` channel-wise and adds ``Linear(enc+dec -> dec) -> SiLU -> Linear(dec -> dec)``
to the stream. When the decoder has fewer blocks than there are skips, the deepest skips are
used (the authors also build fusions for the unused shallow skips; they never run, so none
are built here).

Classic decoder (He et al., ``facebookresearch/mae``): ``Linear(enc -> dec)`` of the encoder's
output, one mask token at masked positions, decoder-width sin-cos position embedding added to
every token (cls row zero).

Both: timm ``Block``s with ``LayerNorm(eps=1e-6)``, a final LayerNorm and ``Linear(dec -> p*p*C)``;
MAE's initialisation (:mod:`lightning_mods.backbone._mae_init`). ``zero_init`` (the authors' choice)
starts ``attn.proj``/``mlp.fc2`` of every block, every fusion's last linear and the prediction
weight at zero; He et al. zero none of them.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Type

import torch
from torch import nn
from timm.models.vision_transformer import Block

from ._mae_init import init_linear_and_norm_, zero_branch_ends_, zero_linear_
from .patches import restore_order, sincos_pos_embed_2d

LayerNorm6 = partial(nn.LayerNorm, eps=1e-6)  # every MAE factory passes eps=1e-6


class SkipFusion(nn.Module):
    """``stream + fc2(SiLU(fc1([skip, stream])))``; ``skip`` = the encoder tokens of one block
    back in patch order, this fusion's ``mask_token`` (encoder width) at masked positions."""

    def __init__(self, dec_dim: int, enc_dim: int, act_layer: Type[nn.Module] = nn.SiLU) -> None:
        super().__init__()
        self.mask_token = nn.Parameter(torch.randn(1, 1, enc_dim) * 0.02)
        self.fc1 = nn.Linear(enc_dim + dec_dim, dec_dim)
        self.act = act_layer()
        self.fc2 = nn.Linear(dec_dim, dec_dim)

    def forward(self, stream: torch.Tensor, tokens: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """``tokens``: one encoder block's output ``B x (1+K) x E`` (cls first, visible patches)."""
        skip = torch.cat([tokens[:, :1], restore_order(tokens[:, 1:], ids_restore, self.mask_token)], dim=1)
        return stream + self.fc2(self.act(self.fc1(torch.cat([skip, stream], dim=-1))))


class _DecoderTail(nn.Module):
    """Standard residual decoder blocks, LayerNorm and the pixel prediction."""

    def __init__(self, dec_dim: int, depth: int, num_heads: int, mlp_ratio: float, patch_dim: int,
                 norm_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(dec_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer) for _ in range(depth))
        self.norm = norm_layer(dec_dim)
        self.pred = nn.Linear(dec_dim, patch_dim)

    def zero_init_(self) -> None:
        """The authors' zero starts: every block's branch ends and the prediction weight."""
        zero_branch_ends_(self.blocks)
        zero_linear_(self.pred)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Pixel prediction of the patch tokens (cls dropped): ``B x L x patch_dim``."""
        return self.pred(self.norm(x))[:, 1:]


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with the strides a fresh tensor of its shape has (``.contiguous()`` keeps a
    ``1 x 1 x D`` slice's strides: size-1 dimensions do not count for it, but DDP compares them)."""
    return grad if grad.stride() == torch.empty(grad.shape, device="meta").stride() else grad.clone(
        memory_format=torch.contiguous_format)


class UNetSkipDecoder(_DecoderTail):
    """The decay paper's MAE decoder with skips from every other encoder block."""

    def __init__(self, num_patches: int, enc_dim: int, enc_depth: int, dec_dim: int = 512, depth: int = 8,
                 num_heads: int = 16, mlp_ratio: float = 4.0, patch_dim: int = 768,
                 norm_layer: Callable[[int], nn.Module] = LayerNorm6, zero_init: bool = True) -> None:
        super().__init__(dec_dim, depth, num_heads, mlp_ratio, patch_dim, norm_layer)
        grid = int(round(num_patches ** 0.5))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.register_buffer("pos_embed", sincos_pos_embed_2d(dec_dim, grid, cls_token=True).unsqueeze(0),
                             persistent=False)
        self.embed = nn.Linear(dec_dim, dec_dim)
        self.skip_sources: list[int] = list(range(1, enc_depth, 2))[::-1][:depth]
        self.fusions = nn.ModuleList(SkipFusion(dec_dim, enc_dim) for _ in self.skip_sources)
        init_linear_and_norm_(self)
        nn.init.normal_(self.cls_token, std=0.02)
        # its gradient is a slice of the concatenated tokens' (strides 17*D, D, 1): given to DDP as
        # is, the reducer warns "grad strides do not match bucket view strides" at every multi-process
        # fit; a contiguous copy has the same values in the layout DDP's buckets use
        self.cls_token.register_hook(_contiguous)
        if zero_init:
            self.zero_init_()
            for fusion in self.fusions:
                zero_linear_(fusion.fc2)

    def forward(self, encoder_outputs: list[torch.Tensor], ids_restore: torch.Tensor) -> torch.Tensor:
        """``encoder_outputs[i]``: block ``i``'s tokens ``B x (1+K) x E`` (cls first)."""
        b = ids_restore.shape[0]
        start = torch.cat([self.cls_token, self.pos_embed[:, 1:].to(self.cls_token.dtype)], dim=1)
        x = self.embed(start.expand(b, -1, -1))
        for i, blk in enumerate(self.blocks):
            if i < len(self.fusions):
                x = self.fusions[i](x, encoder_outputs[self.skip_sources[i]], ids_restore)
            x = blk(x)
        return self.head(x)


class ClassicDecoder(_DecoderTail):
    """He et al.'s MAE decoder: embed the encoder's last output, add mask tokens, decode."""

    def __init__(self, num_patches: int, enc_dim: int, dec_dim: int = 512, depth: int = 8, num_heads: int = 16,
                 mlp_ratio: float = 4.0, patch_dim: int = 768,
                 norm_layer: Callable[[int], nn.Module] = LayerNorm6, zero_init: bool = False) -> None:
        super().__init__(dec_dim, depth, num_heads, mlp_ratio, patch_dim, norm_layer)
        grid = int(round(num_patches ** 0.5))
        self.embed = nn.Linear(enc_dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.register_buffer("pos_embed", sincos_pos_embed_2d(dec_dim, grid, cls_token=True).unsqueeze(0),
                             persistent=False)
        init_linear_and_norm_(self)
        nn.init.normal_(self.mask_token, std=0.02)
        if zero_init:
            self.zero_init_()

    def forward(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """``latent``: the encoder's output ``B x (1+K) x E``."""
        x = self.embed(latent)
        patches = restore_order(x[:, 1:], ids_restore, self.mask_token)
        x = torch.cat([x[:, :1], patches], dim=1) + self.pos_embed.to(x.dtype)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)
