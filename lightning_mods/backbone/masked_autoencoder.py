"""The masked autoencoder as a plain ``nn.Module``: encoder with decayed identity shortcuts, decoder
with U-Net skips, masking and loss (the decay paper, section 4; "Residual Connections Harm
Generative Representation Learning", section 3.2 and appendix A). No Lightning: it trains in a
plain PyTorch loop (``loss, pred, mask = net(images); loss.backward()``), and
:class:`lightning_mods.mae.MaskedAutoencoder` trains it (the recipe holds it as ``network``).

Encoder: a :class:`~lightning_mods.backbone.vit.DecayedVisionTransformer` (patch embed, fixed 2-D
sin-cos position embedding, cls token) run on the visible patches of a per-sample random mask
(``int(L * (1 - mask_ratio))`` kept). Decoder: :mod:`lightning_mods.backbone.mae_decoder`. Loss: MSE on
masked patches only, optionally against per-patch normalised pixels (``norm_pix_loss``).
Evaluation features: mean over all tokens (cls included) of the encoder's output.

Two layouts, parameter for parameter: with ``unet_skips=True`` the decay paper's model
(``xiao7199/decayed_Identity_shortcuts``, ``MAE/models_mae.py``: no final encoder norm, every
branch end, fusion output and the prediction zero-initialised); with ``unet_skips=False`` and
``alpha_min=1`` He et al.'s MAE (``facebookresearch/mae``: final encoder LayerNorm, no zero
starts). Both use MAE's initialisation (:mod:`lightning_mods.backbone._mae_init`) and LayerNorm
eps 1e-6. :func:`lightning_mods.backbone.mae_weights.checkpoint_filter_fn` maps both repositories'
weights to these.

Extension points (the methods a subclass overrides; ``docs/extending.md``, ``examples/``):
:meth:`MaskedAutoencoderViT.mask_patches`, :meth:`~MaskedAutoencoderViT.reconstruction_target`
(with :meth:`~MaskedAutoencoderViT.target_to_pixels`), :meth:`~MaskedAutoencoderViT.reconstruction_loss`
and :meth:`~MaskedAutoencoderViT.pool_features`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Optional, Union

import torch
from torch import nn

from .mae_decoder import ClassicDecoder, UNetSkipDecoder
from ._mae_init import init_linear_and_norm_, init_patch_embed_, zero_branch_ends_
from .patches import num_kept, patchify, random_masking, sincos_pos_embed_2d, unpatchify
from .shortcut import ShortcutSchedule, check_depth, check_heads, transformer_sublayer_types
from .vit import DecayedVisionTransformer

Indices = Optional[Union[int, Sequence[int]]]  # of forward_intermediates, as timm reads them
Generators = Union[torch.Generator, Sequence[torch.Generator], None]  # of the masks: one for the batch or one per image

def masked_patch_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error per patch, averaged over masked patches (``mask`` 1 = masked)."""
    per_patch = ((pred - target) ** 2).mean(dim=-1)
    return (per_patch * mask).sum() / mask.sum().clamp_min(1.0)


def normalise_patches(target: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-patch pixel normalisation of ``norm_pix_loss`` (mean 0, unit variance per patch)."""
    mean = target.mean(dim=-1, keepdim=True)
    var = target.var(dim=-1, keepdim=True)
    return (target - mean) / (var + eps) ** 0.5


def check_layout(img_size: int, patch_size: int, depth: int, mask_ratio: float, loss_on_all_patches: bool,
                 unet_skips: bool, encoder_final_norm: Optional[bool], feature_pool: str) -> None:
    """One-line errors for an MAE that cannot be built or cannot train."""
    if loss_on_all_patches and not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1) with loss_on_all_patches, got {mask_ratio}")
    if not loss_on_all_patches and not 0.0 < mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in (0, 1) (the loss counts masked patches only: at 0 it is 0 at "
                         f"every step), got {mask_ratio}; for a plain autoencoder set loss_on_all_patches=true")
    if img_size % patch_size:
        raise ValueError(f"img_size ({img_size}) must be divisible by patch_size ({patch_size})")
    check_depth(depth, "depth", " (encoder blocks)")
    if unet_skips and depth % 2:
        raise ValueError(f"depth must be even with unet_skips=True (skips leave blocks 1, 3, 5, ...; the last "
                         f"of {depth} blocks would get no training signal), got {depth}")
    if unet_skips and encoder_final_norm:
        raise ValueError("encoder_final_norm: with unet_skips=True the decoder reads the blocks' outputs, so a "
                         "final norm would never be trained; set encoder_final_norm=false (the authors have none) "
                         "or unet_skips=false")
    if feature_pool not in ("mean", "cls"):
        raise ValueError(f"feature_pool must be 'mean' or 'cls', got {feature_pool!r}")
    grid = img_size // patch_size
    num_kept(grid * grid, mask_ratio)  # one-line error when no patch stays visible


class MaskedAutoencoderViT(nn.Module):
    """MAE with decayed shortcuts in the encoder and U-Net skips into the decoder (module docstring).

    ``zero_init_branches=None`` zeroes the branch ends with ``unet_skips`` or a decayed encoder (He
    et al.'s standard MAE zeroes none); ``encoder_final_norm=None`` is ``not unet_skips``;
    ``shortcut=None`` is :class:`~lightning_mods.backbone.shortcut.ShortcutSchedule`'s default (linear,
    the decay paper's). The resolved values are attributes of the built network, and
    :attr:`settings` holds every argument as plain data (what a checkpoint records to rebuild it).
    """

    num_classes = 0  # no classifier, as timm's factory and hub layout read it (its registry cfg says 0)

    def __init__(self, img_size: int = 224, in_chans: int = 3, patch_size: int = 16, embed_dim: int = 768,
                 depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 shortcut: Optional[ShortcutSchedule] = None, zero_init_branches: Optional[bool] = None,
                 encoder_final_norm: Optional[bool] = None, decoder_embed_dim: int = 512, decoder_depth: int = 8,
                 decoder_num_heads: int = 16, unet_skips: bool = True, norm_pix_loss: bool = True,
                 mask_ratio: float = 0.75, loss_on_all_patches: bool = False,
                 feature_pool: Literal["mean", "cls"] = "mean") -> None:
        super().__init__()
        check_layout(img_size, patch_size, depth, mask_ratio, loss_on_all_patches, unet_skips, encoder_final_norm,
                     feature_pool)
        check_heads(embed_dim, num_heads)
        check_heads(decoder_embed_dim, decoder_num_heads, "decoder_embed_dim", "decoder_num_heads")
        self.shortcut = shortcut = ShortcutSchedule.coerce(shortcut, ShortcutSchedule())
        # zero starts: the authors' with skips; the decay paper needs them for any decayed encoder too (a
        # decayed classic-decoder ablation), while He et al.'s standard MAE has none
        standard = all(w == (1.0, 1.0) for w in shortcut.weights(2 * depth, transformer_sublayer_types(depth)))
        self.zero_init_branches = bool(unet_skips or not standard if zero_init_branches is None else zero_init_branches)
        self.encoder_final_norm = (not unet_skips) if encoder_final_norm is None else bool(encoder_final_norm)
        self.img_size, self.in_chans, self.patch_size = img_size, in_chans, patch_size
        self.unet_skips, self.norm_pix_loss, self.mask_ratio = unet_skips, norm_pix_loss, mask_ratio
        self.loss_on_all_patches, self.feature_pool = loss_on_all_patches, feature_pool
        self.settings = dict(
            img_size=img_size, in_chans=in_chans, patch_size=patch_size, embed_dim=embed_dim, depth=depth,
            num_heads=num_heads, mlp_ratio=mlp_ratio, shortcut=shortcut.as_dict(),
            zero_init_branches=self.zero_init_branches, encoder_final_norm=self.encoder_final_norm,
            decoder_embed_dim=decoder_embed_dim, decoder_depth=decoder_depth, decoder_num_heads=decoder_num_heads,
            unet_skips=unet_skips, norm_pix_loss=norm_pix_loss, mask_ratio=mask_ratio,
            loss_on_all_patches=loss_on_all_patches, feature_pool=feature_pool)
        self.encoder = self._mae_encoder(embed_dim, depth, num_heads, mlp_ratio)
        patch_dim = patch_size * patch_size * in_chans
        decoder = UNetSkipDecoder if unet_skips else ClassicDecoder
        grid = img_size // patch_size
        layout = (grid * grid, embed_dim, depth) if unet_skips else (grid * grid, embed_dim)
        self.decoder: nn.Module = decoder(*layout, decoder_embed_dim, decoder_depth, decoder_num_heads, mlp_ratio,
                                          patch_dim, zero_init=self.zero_init_branches)
        self.num_features = embed_dim

    def _mae_encoder(self, embed_dim: int, depth: int, num_heads: int, mlp_ratio: float) -> DecayedVisionTransformer:
        """The decayed ViT on the image, with MAE's initialisation and fixed sin-cos positions."""
        encoder = DecayedVisionTransformer(
            shortcut=self.shortcut, zero_init_branches=False,
            img_size=self.img_size, patch_size=self.patch_size, in_chans=self.in_chans, embed_dim=embed_dim,
            depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=True, class_token=True, global_pool="",
            num_classes=0, final_norm=self.encoder_final_norm)
        # MAE's initialisation replaces timm's (trunc-normal 0.02 linears, cls token 1e-6)
        init_linear_and_norm_(encoder)
        init_patch_embed_(encoder.patch_embed.proj)
        grid = self.img_size // self.patch_size
        with torch.no_grad():  # fixed sin-cos position embedding, cls position = 0
            nn.init.normal_(encoder.cls_token, std=0.02)
            encoder.pos_embed.copy_(sincos_pos_embed_2d(embed_dim, grid, cls_token=True).unsqueeze(0))
        encoder.pos_embed.requires_grad_(False)
        if self.zero_init_branches:
            zero_branch_ends_(encoder.blocks)
        return encoder

    # --- encoder -------------------------------------------------------------------------
    def _embed_patches(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder.patch_embed(images) + self.encoder.pos_embed[:, 1:]

    def _cls(self, batch: int) -> torch.Tensor:
        return (self.encoder.cls_token + self.encoder.pos_embed[:, :1]).expand(batch, -1, -1)

    def _run_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outputs = []
        for blk in self.encoder.blocks:
            x = blk(x)
            outputs.append(x)
        return self.encoder.norm(x), outputs

    def mask_patches(self, tokens: torch.Tensor, mask_ratio: float, generator: Generators = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Extension point: which patches the encoder sees. ``tokens`` are the embedded patches
        ``B x L x D`` in patch order; returns ``(visible B x K x D, mask B x L with 1 = hidden,
        ids_restore B x L)``, ``ids_restore`` putting ``[visible, hidden]`` back in patch order
        (every sample keeps the same ``K``). Default: a uniformly random ``int(L * (1 - mask_ratio))``
        per sample, drawn from ``generator`` (one per sample in validation; the global RNG when None)."""
        visible, mask, ids_restore, _ = random_masking(tokens, mask_ratio, generator)
        return visible, mask, ids_restore

    def encode_masked(self, images: torch.Tensor, mask_ratio: float, generator: Generators = None):
        """Encoder on the visible patches: ``(latent, block outputs, mask, ids_restore)``."""
        visible, mask, ids_restore = self.mask_patches(self._embed_patches(images), mask_ratio, generator)
        x = torch.cat([self._cls(images.shape[0]), visible], dim=1)
        latent, outputs = self._run_blocks(x)
        return latent, outputs, mask, ids_restore

    def encode(self, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Encoder on all patches (evaluation): ``(last output, every block's output)``."""
        x = torch.cat([self._cls(images.shape[0]), self._embed_patches(images)], dim=1)
        return self._run_blocks(x)

    def pool_features(self, tokens: torch.Tensor) -> torch.Tensor:
        """Extension point: evaluation features ``B x D`` from a block's tokens ``B x (1 + L) x D``
        (cls first). Default: ``feature_pool`` (mean over all tokens, or the cls token)."""
        return tokens[:, 0] if self.feature_pool == "cls" else tokens.mean(dim=1)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Evaluation features ``B x D``: mean over all tokens (or cls) of the last block."""
        return self.pool_features(self.encode(images)[0])

    def forward_intermediates(self, images: torch.Tensor, indices: Indices = None, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False,
                              **kwargs):
        """timm's call with timm's meaning: the encoder's (a ``DecayedVisionTransformer``'s)
        ``forward_intermediates`` on all patches, block outputs as ``NCHW`` maps by default (every
        argument of timm's ViT, ``return_prefix_tokens`` included)."""
        return self.encoder.forward_intermediates(images, indices, norm=norm, stop_early=stop_early,
                                                  output_fmt=output_fmt, intermediates_only=intermediates_only,
                                                  **kwargs)

    def pooled_intermediates(self, images: torch.Tensor, indices: Indices = None, intermediates_only: bool = False):
        """``(forward_features, pooled output of the encoder blocks indices picks)`` from one pass of
        the encoder's timm ``forward_intermediates``, each block's tokens (cls first) through
        :meth:`pool_features`: what the evaluations read
        (:mod:`lightning_mods.evaluation.feature_contract`)."""
        final, blocks = self.encoder.forward_intermediates(images, indices, output_fmt="NLC",
                                                           return_prefix_tokens=True)
        pooled = [self.pool_features(torch.cat([prefix, spatial], dim=1)) for spatial, prefix in blocks]
        return pooled if intermediates_only else (self.pool_features(final), pooled)

    def forward_patch_features(self, images: torch.Tensor, block: int = -1) -> torch.Tensor:
        """Patch tokens of encoder block ``block`` (Python index; -1 the last) on their grid,
        ``B x H/p x W/p x D`` (the cls token dropped): the paper's pixel-wise embeddings (Fig. 3)."""
        tokens = self.encode(images)[1][block][:, 1:]
        grid = self.img_size // self.patch_size
        return tokens.reshape(tokens.shape[0], grid, grid, tokens.shape[-1])

    # --- reconstruction --------------------------------------------------------------------
    def forward(self, images: torch.Tensor, mask_ratio: Optional[float] = None, generator: Generators = None):
        """``(loss, predicted patches B x L x p*p*C, mask B x L)``; ``generator``: of the masks, one
        for the batch or one per image (None: the global RNG)."""
        ratio = self.mask_ratio if mask_ratio is None else mask_ratio
        latent, outputs, mask, ids_restore = self.encode_masked(images, ratio, generator)
        pred = self.decoder(outputs, ids_restore) if self.unet_skips else self.decoder(latent, ids_restore)
        target = self.reconstruction_target(images)
        loss_mask = torch.ones_like(mask) if self.loss_on_all_patches else mask
        return self.reconstruction_loss(pred, target, loss_mask), pred, mask

    def reconstruction_target(self, images: torch.Tensor) -> torch.Tensor:
        """Extension point: what the decoder predicts, ``B x L x p*p*C`` in patch order (the
        prediction's width). Default: the patches' pixels, normalised per patch under
        ``norm_pix_loss``."""
        target = patchify(images, self.patch_size)
        return normalise_patches(target) if self.norm_pix_loss else target

    def target_to_pixels(self, pred: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """A prediction ``B x L x p*p*C`` back in pixel patches, for the reconstruction picture
        (the inverse of :meth:`reconstruction_target`; ``images`` give the true statistics)."""
        if not self.norm_pix_loss:
            return pred
        target = patchify(images, self.patch_size)
        mean = target.mean(dim=-1, keepdim=True)
        std = (target.var(dim=-1, keepdim=True) + 1e-6) ** 0.5
        return pred * std + mean

    def reconstruction_loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Extension point: the training and validation loss. ``pred``, ``target``: ``B x L x D``;
        ``mask``: ``B x L``, 1 where a patch counts (the hidden ones; all under
        ``loss_on_all_patches``). Default: mean squared error per patch, averaged over those."""
        return masked_patch_loss(pred, target, mask)

    @torch.no_grad()
    def reconstruct(self, images: torch.Tensor, generator: Optional[torch.Generator] = None):
        """``(masked input, reconstruction with visible patches pasted back)`` in input space."""
        _, pred, mask = self(images, generator=generator)
        p, c = self.patch_size, self.in_chans
        target = patchify(images, p)
        pred = self.target_to_pixels(pred, images)
        m = mask.unsqueeze(-1)
        masked = unpatchify(target * (1 - m), p, c)
        pasted = unpatchify(target * (1 - m) + pred * m, p, c)
        return masked, pasted
