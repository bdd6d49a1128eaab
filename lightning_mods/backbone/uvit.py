"""U-ViT (Bao et al. 2023) with decayed identity shortcuts through every block (the decay paper, section 5;
"Residual Connections Harm Generative Representation Learning", section 5).

Tokens: ``[class token,] time token, patch tokens`` plus a learned position embedding. The
transformer is ``depth // 2`` in-blocks, one mid block and ``depth // 2`` out-blocks; before
out-block ``i`` the stream is concatenated channel-wise with the output of the matching
in-block (last in, first out) and fused back to the width by ``Linear(2D -> D)``. Then a final
LayerNorm, a linear map to patch pixels, unpatchify and an optional 3x3 conv.

Every block is the shared :class:`~lightning_mods.backbone.vit.DecayedBlock`; the shortcut schedule runs
over all ``2 * num_blocks`` residual sub-layers in depth order in -> mid -> out (the blocks are
registered in that order, which is the order ``apply_shortcut_schedule`` assigns in). With the
``none`` schedule this is the plain U-ViT, number for number.

A class-conditional U-ViT has ``num_classes + 1`` class embeddings; the last one is the null
class used for label dropout and classifier-free guidance.
"""
from __future__ import annotations

import math
from typing import Optional, Type

import torch
from timm.layers import PatchEmbed, trunc_normal_
from torch import nn

from .patches import unpatchify
from .residual import apply_shortcut_schedule
from .resnet import resolve_layer
from .shortcut import ShortcutSchedule, check_heads
from .vit import DecayedBlock, zero_init_residual_branches


def timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding ``B -> B x dim``: ``[cos(t f_i), sin(t f_i)]``, ``f_i = max_period^(-i/half)``."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
    args = timesteps[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


def check_geometry(img_size: int, patch_size: int, in_chans: int, embed_dim: int, depth: int, num_heads: int,
                   num_classes: int) -> None:
    """One-line errors for a U-ViT that cannot be built."""
    for name, value in (("img_size", img_size), ("patch_size", patch_size), ("in_chans", in_chans),
                        ("embed_dim", embed_dim), ("depth", depth), ("num_heads", num_heads)):
        if value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if img_size % patch_size:
        raise ValueError(f"img_size ({img_size}) must be divisible by patch_size ({patch_size})")
    check_heads(embed_dim, num_heads)
    if num_classes < 0:
        raise ValueError(f"num_classes must be >= 0 (0 = unconditional), got {num_classes}")


class UViT(nn.Module):
    """Noise-prediction U-ViT whose blocks decay their identity shortcuts.

    Args:
        img_size, patch_size, in_chans: input geometry (pixels or VAE latents).
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: transformer; ``depth // 2`` in- and
            out-blocks plus one mid block (U-ViT-S: 512, 12, 8 heads, no qkv bias).
        num_classes: > 0 adds a class token (``num_classes`` classes plus the null class).
        mlp_time_embed: pass the sinusoidal time embedding through Linear-SiLU-Linear.
        final_conv: 3x3 conv on the unpatchified output.
        shortcut: the schedule over all ``2 * num_blocks`` sub-layers; ``None`` = plain U-ViT.
        zero_init_branches: zero the last linear layer of every residual branch.
        norm_layer, act_layer: as timm's ``Block``.

    :attr:`settings` holds every argument as plain data (the classes as import paths): what a
    checkpoint records to rebuild it.
    """

    def __init__(
        self,
        img_size: int = 32, patch_size: int = 2, in_chans: int = 3,
        embed_dim: int = 512,
        depth: int = 12,
        num_heads: int = 8,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        num_classes: int = 0,
        mlp_time_embed: bool = False,
        final_conv: bool = True,
        shortcut: Optional[ShortcutSchedule] = None,
        zero_init_branches: bool = False,
        norm_layer: Type[nn.Module] = nn.LayerNorm,
        act_layer: Type[nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        check_geometry(img_size, patch_size, in_chans, embed_dim, depth, num_heads, num_classes)
        norm_layer, act_layer = resolve_layer(norm_layer), resolve_layer(act_layer)  # dotted paths: :attr:`settings`
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        self.num_features = self.embed_dim = embed_dim
        self.num_classes = num_classes

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.time_embed: nn.Module = nn.Sequential(
            nn.Linear(embed_dim, 4 * embed_dim), nn.SiLU(), nn.Linear(4 * embed_dim, embed_dim),
        ) if mlp_time_embed else nn.Identity()
        if num_classes > 0:
            self.label_emb = nn.Embedding(num_classes + 1, embed_dim)  # last row: the null class
        self.num_prefix_tokens = 2 if num_classes > 0 else 1
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix_tokens + num_patches, embed_dim))

        def block() -> DecayedBlock:
            return DecayedBlock(embed_dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                                norm_layer=norm_layer, act_layer=act_layer)

        # registration order in -> mid -> out is the depth order of the shortcut schedule
        self.in_blocks = nn.ModuleList([block() for _ in range(depth // 2)])
        self.mid_block = block()
        self.out_blocks = nn.ModuleList([block() for _ in range(depth // 2)])
        self.skip_fusions = nn.ModuleList([nn.Linear(2 * embed_dim, embed_dim) for _ in range(depth // 2)])

        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(embed_dim, patch_size * patch_size * in_chans)
        self.final_layer: nn.Module = nn.Conv2d(in_chans, in_chans, 3, padding=1) if final_conv else nn.Identity()

        trunc_normal_(self.pos_embed, std=0.02)
        self.apply(self._init_weights)
        self.shortcut = ShortcutSchedule.coerce(shortcut)
        self.num_sublayers = apply_shortcut_schedule(self, self.shortcut)
        self.settings = dict(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim, depth=depth,
            num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, num_classes=num_classes,
            mlp_time_embed=mlp_time_embed, final_conv=final_conv, shortcut=self.shortcut.as_dict(),
            zero_init_branches=zero_init_branches, norm_layer=f"{norm_layer.__module__}.{norm_layer.__qualname__}",
            act_layer=f"{act_layer.__module__}.{act_layer.__qualname__}")
        if zero_init_branches:
            zero_init_residual_branches(self)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    @property
    def num_blocks(self) -> int:
        return len(self.in_blocks) + 1 + len(self.out_blocks)

    @property
    def null_class(self) -> int:
        """Label index of the null class (class-conditional models only)."""
        if self.num_classes <= 0:
            raise ValueError("null_class: this U-ViT is unconditional (num_classes=0)")
        return self.num_classes

    def blocks_in_depth_order(self) -> list[DecayedBlock]:
        return [*self.in_blocks, self.mid_block, *self.out_blocks]

    def embed(self, x: torch.Tensor, timesteps: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tokens ``B x (prefix + patches) x D`` with position embedding; ``y=None`` = null class."""
        patches = self.patch_embed(x)
        if timesteps.ndim == 0:
            timesteps = timesteps.expand(x.shape[0])
        tokens = [self.time_embed(timestep_embedding(timesteps, self.embed_dim)).unsqueeze(1), patches]
        if self.num_classes > 0:
            if y is None:
                y = torch.full((x.shape[0],), self.num_classes, dtype=torch.long, device=x.device)
            tokens.insert(0, self.label_emb(y).unsqueeze(1))
        elif y is not None:
            raise ValueError("y: this U-ViT is unconditional (num_classes=0); pass y=None")
        return torch.cat(tokens, dim=1) + self.pos_embed

    def forward_blocks(self, x: torch.Tensor, timesteps: torch.Tensor, y: Optional[torch.Tensor] = None,
                       num_blocks: Optional[int] = None) -> list[torch.Tensor]:
        """Token outputs of the first ``num_blocks`` blocks (all by default) in depth order."""
        stop = self.num_blocks if num_blocks is None else num_blocks
        if not 0 <= stop <= self.num_blocks:
            raise ValueError(f"num_blocks must be in [0, {self.num_blocks}], got {num_blocks}")
        return self._run(self.embed(x, timesteps, y), stop)[1]

    def _run(self, x: torch.Tensor, stop: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outputs: list[torch.Tensor] = []
        skips: list[torch.Tensor] = []
        for blk in self.in_blocks:
            if len(outputs) == stop:
                return x, outputs
            x = blk(x)
            skips.append(x)
            outputs.append(x)
        if len(outputs) == stop:
            return x, outputs
        x = self.mid_block(x)
        outputs.append(x)
        for fuse, blk in zip(self.skip_fusions, self.out_blocks):
            if len(outputs) == stop:
                return x, outputs
            x = blk(fuse(torch.cat([x, skips.pop()], dim=-1)))
            outputs.append(x)
        return x, outputs

    def forward_features(self, x: torch.Tensor, timesteps: torch.Tensor,
                         y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """All tokens after the last block and the final LayerNorm."""
        return self.norm(self._run(self.embed(x, timesteps, y), self.num_blocks)[0])

    def forward_head(self, tokens: torch.Tensor) -> torch.Tensor:
        """Normed tokens -> ``B x C x H x W`` prediction (patch tokens only)."""
        patches = self.head(tokens)[:, self.num_prefix_tokens:]  # as Bao et al.: the head over every token
        return self.final_layer(unpatchify(patches, self.patch_size, self.in_chans))

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Predicted noise for ``x`` at integer ``timesteps`` (``B`` or scalar), class ``y``."""
        return self.forward_head(self.forward_features(x, timesteps, y))
