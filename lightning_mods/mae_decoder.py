"""MAE decoders (SPEC section 2): the U-Net-skip decoder of the decay paper and, for its
ablation, the classic MAE decoder fed with the encoder's last output.

U-Net-skip decoder (authors' code). The decoder stream does not start from the encoder
output: it starts from a learned decoder cls token and fixed sin-cos position embeddings of
every patch (encoder width), through a linear embed. Skips come from every other encoder block
(0-indexed blocks 1, 3, 5, ...), the deepest entering the first decoder block. Before a decoder
block with a skip, the encoder tokens of that block (visible patches) are put back in patch
order with a learned mask token at masked positions, concatenated channel-wise with the stream,
and ``Linear(dec+enc -> dec) -> SiLU -> Linear(dec -> dec, zero init)`` is added to the stream.
When the decoder has fewer blocks than there are skips, the deepest skips are used.
"""
from __future__ import annotations

from typing import Callable, Type

import torch
from torch import nn
from timm.models.vision_transformer import Block

from .patches import restore_order, sincos_pos_embed_2d


def _xavier_linear_init(module: nn.Module) -> None:
    """MAE's initialisation: xavier-uniform linear weights, zero biases, unit LayerNorm."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class SkipFusion(nn.Module):
    """``stream + Linear(SiLU(Linear([stream, skip])))`` with the last linear zero-initialised."""

    def __init__(self, dec_dim: int, enc_dim: int, act_layer: Type[nn.Module] = nn.SiLU) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dec_dim + enc_dim, dec_dim)
        self.act = act_layer()
        self.fc2 = nn.Linear(dec_dim, dec_dim)

    def zero_init_last(self) -> None:
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, stream: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return stream + self.fc2(self.act(self.fc1(torch.cat([stream, skip], dim=-1))))


class _DecoderTail(nn.Module):
    """Standard residual decoder blocks, LayerNorm and the zero-initialised pixel prediction."""

    def __init__(self, dec_dim: int, depth: int, num_heads: int, mlp_ratio: float, patch_dim: int,
                 norm_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            Block(dec_dim, num_heads, mlp_ratio, qkv_bias=True, norm_layer=norm_layer) for _ in range(depth))
        self.norm = norm_layer(dec_dim)
        self.pred = nn.Linear(dec_dim, patch_dim)

    def zero_init_prediction(self) -> None:
        nn.init.zeros_(self.pred.weight)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Pixel prediction of the patch tokens (cls dropped): ``B x L x patch_dim``."""
        return self.pred(self.norm(x))[:, 1:]


class UNetSkipDecoder(_DecoderTail):
    """The decay paper's MAE decoder with skips from every other encoder block."""

    def __init__(self, num_patches: int, enc_dim: int, enc_depth: int, dec_dim: int = 512, depth: int = 8,
                 num_heads: int = 16, mlp_ratio: float = 4.0, patch_dim: int = 768,
                 norm_layer: Callable[[int], nn.Module] = nn.LayerNorm) -> None:
        super().__init__(dec_dim, depth, num_heads, mlp_ratio, patch_dim, norm_layer)
        grid = int(round(num_patches ** 0.5))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, enc_dim))
        self.register_buffer("pos_embed", sincos_pos_embed_2d(enc_dim, grid).unsqueeze(0), persistent=False)
        self.embed = nn.Linear(enc_dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, enc_dim))
        self.skip_sources: list[int] = list(range(1, enc_depth, 2))[::-1][:depth]
        self.fusions = nn.ModuleList(SkipFusion(dec_dim, enc_dim) for _ in self.skip_sources)
        _xavier_linear_init(self)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.mask_token, std=0.02)
        for fusion in self.fusions:
            fusion.zero_init_last()
        self.zero_init_prediction()

    def forward(self, encoder_outputs: list[torch.Tensor], ids_restore: torch.Tensor) -> torch.Tensor:
        """``encoder_outputs[i]``: block ``i``'s tokens ``B x (1+K) x E`` (cls first)."""
        b = ids_restore.shape[0]
        start = torch.cat([self.cls_token, self.pos_embed.to(self.cls_token.dtype)], dim=1)
        x = self.embed(start).expand(b, -1, -1)
        for i, blk in enumerate(self.blocks):
            if i < len(self.skip_sources):
                tokens = encoder_outputs[self.skip_sources[i]]
                skip = torch.cat([tokens[:, :1], restore_order(tokens[:, 1:], ids_restore, self.mask_token)], dim=1)
                x = self.fusions[i](x, skip)
            x = blk(x)
        return self.head(x)


class ClassicDecoder(_DecoderTail):
    """He et al.'s MAE decoder: embed the encoder's last output, add mask tokens, decode."""

    def __init__(self, num_patches: int, enc_dim: int, dec_dim: int = 512, depth: int = 8, num_heads: int = 16,
                 mlp_ratio: float = 4.0, patch_dim: int = 768,
                 norm_layer: Callable[[int], nn.Module] = nn.LayerNorm) -> None:
        super().__init__(dec_dim, depth, num_heads, mlp_ratio, patch_dim, norm_layer)
        grid = int(round(num_patches ** 0.5))
        self.embed = nn.Linear(enc_dim, dec_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.register_buffer("pos_embed", sincos_pos_embed_2d(dec_dim, grid, cls_token=True).unsqueeze(0),
                             persistent=False)
        _xavier_linear_init(self)
        nn.init.normal_(self.mask_token, std=0.02)
        self.zero_init_prediction()

    def forward(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """``latent``: the encoder's output ``B x (1+K) x E``."""
        x = self.embed(latent)
        patches = restore_order(x[:, 1:], ids_restore, self.mask_token)
        x = torch.cat([x[:, :1], patches], dim=1) + self.pos_embed.to(x.dtype)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)
