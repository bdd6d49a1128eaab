"""Masked autoencoder with decayed identity shortcuts in the encoder and U-Net skips into the
decoder (the decay paper, section 4; "Residual Connections Harm Generative Representation Learning",
section 3.2 and appendix A).

Encoder: a :class:`~lightning_mods.backbone.vit.DecayedVisionTransformer` (patch embed, fixed 2-D
sin-cos position embedding, cls token) run on the visible patches of a per-sample random mask
(``int(L * (1 - mask_ratio))`` kept). Decoder: :mod:`lightning_mods.backbone.mae_decoder`. Loss: MSE on
masked patches only, optionally against per-patch normalised pixels (``norm_pix_loss``).
Evaluation features: mean over all tokens (cls included) of the encoder's output.

Two layouts, parameter for parameter: with ``unet_skips=True`` the decay paper's model
(``xiao7199/decayed_Identity_shortcuts``, ``MAE/models_mae.py``: no final encoder norm, every
branch end, fusion output and the prediction zero-initialised); with ``unet_skips=False`` and
``alpha_min=1`` He et al.'s MAE (``facebookresearch/mae``: final encoder LayerNorm, no zero
starts). Both use MAE's initialisation (:mod:`lightning_mods.backbone.mae_init`) and LayerNorm eps 1e-6.

Extension points (the methods a subclass overrides; ``docs/extending.md``, ``examples/``):

- :meth:`MaskedAutoencoder.mask_patches`: which patches are visible.
- :meth:`MaskedAutoencoder.reconstruction_target`: what the decoder predicts for each patch
  (and :meth:`MaskedAutoencoder.target_to_pixels`, its inverse for the reconstruction picture).
- :meth:`MaskedAutoencoder.reconstruction_loss`: the loss of a prediction against the target.
- :meth:`MaskedAutoencoder.pool_features`: the evaluation features from the encoder's tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Optional, Union

import numpy as np
import torch
from torchmetrics import MeanMetric
from jsonargparse import lazy_instance
from lightning.pytorch import LightningModule
from torch import nn

from lightning_mods.evaluation import metric_names
from lightning_mods.pictures.grids import labelled_grid, log_picture
from lightning_mods.backbone.mae_decoder import ClassicDecoder, UNetSkipDecoder
from lightning_mods.backbone.mae_init import init_linear_and_norm_, init_patch_embed_, zero_branch_ends_
from lightning_mods.training.optim import (adamw, global_batch_size, param_groups_weight_decay, scaled_lr, steps_from_epochs,
                    warmup_cosine_scheduler)
from lightning_mods.backbone.patches import num_kept, patchify, random_masking, sincos_pos_embed_2d, unpatchify
from lightning_mods.backbone.shortcut import ShortcutSchedule, check_depth, transformer_sublayer_types
from lightning_mods.backbone.vit import DecayedVisionTransformer
from lightning_mods.evaluation.distributed_eval import ExactEvaluation
from lightning_mods.evaluation.feature_contract import Indices, take_indices

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


class MaskedAutoencoder(ExactEvaluation, LightningModule):
    """MAE pre-training with decayed shortcuts; defaults follow the paper's recipe (ViT-B/16).

    Args:
        image_size, in_chans: input geometry (linked from the datamodule by the CLI).
        patch_size, embed_dim, depth, num_heads, mlp_ratio: encoder ViT.
        shortcut: decay schedule of the encoder's ``2 * depth`` sub-layers.
        zero_init_branches: start the last linear layer of every residual branch (encoder and
            decoder blocks, skip fusions) and the pixel prediction at zero weight, as the
            decay paper's authors; ``None`` = ``unet_skips`` or a decayed encoder (He et al.'s
            standard MAE zeroes none).
        encoder_final_norm: LayerNorm after the last encoder block, read by the classic
            decoder and the features; ``None`` = ``not unet_skips`` (the authors have none,
            He et al. have one).
        decoder_embed_dim, decoder_depth, decoder_num_heads: decoder transformer.
        unet_skips: the paper's skip decoder; ``False`` = classic MAE decoder (ablation).
        norm_pix_loss: per-patch normalised pixel target.
        mask_ratio: fraction of patches masked, in (0, 1); 0 only with ``loss_on_all_patches``.
        loss_on_all_patches: the loss counts every patch, visible ones too (MAE's "loss on all
            pixels" ablation); with ``mask_ratio=0`` a plain autoencoder. Default: masked patches only.
        feature_pool: evaluation features, ``mean`` of all tokens or the ``cls`` token.
        base_lr: learning rate per 256 samples of GLOBAL batch (peak = base_lr * batch / 256).
        weight_decay, betas: AdamW; no decay on 1-D parameters (norms, biases) and learnable
            alphas; the cls and mask tokens are decayed, as in both MAE repositories.
        warmup_epochs: linear per-step warm-up, then cosine to ``min_lr_ratio * peak``.
        num_reconstructions: validation images drawn (original / masked / reconstruction).
    """

    def __init__(
        self,
        image_size: int = 224,
        in_chans: int = 3,
        patch_size: int = 16,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        shortcut: Optional[ShortcutSchedule] = lazy_instance(ShortcutSchedule, kind="linear", alpha_min=0.6),
        zero_init_branches: Optional[bool] = None,
        encoder_final_norm: Optional[bool] = None,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
        unet_skips: bool = True,
        norm_pix_loss: bool = True,
        mask_ratio: float = 0.75,
        loss_on_all_patches: bool = False,
        feature_pool: Literal["mean", "cls"] = "mean",
        base_lr: float = 1.5e-4,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_epochs: float = 40.0,
        min_lr_ratio: float = 0.0,
        num_reconstructions: int = 8,
    ) -> None:
        super().__init__()
        if loss_on_all_patches and not 0.0 <= mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in [0, 1) with loss_on_all_patches, got {mask_ratio}")
        if not loss_on_all_patches and not 0.0 < mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in (0, 1) (the loss counts masked patches only: at 0 it is 0 at "
                             f"every step), got {mask_ratio}; for a plain autoencoder set loss_on_all_patches=true")
        if image_size % patch_size:
            raise ValueError(f"image_size ({image_size}) must be divisible by patch_size ({patch_size})")
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
        grid = image_size // patch_size
        num_kept(grid * grid, mask_ratio)  # one-line error when no patch stays visible
        self.shortcut = ShortcutSchedule.coerce(shortcut, ShortcutSchedule("linear", 0.6))
        # zero starts: the authors' with skips; the decay paper needs them for any decayed encoder too (a
        # decayed classic-decoder ablation), while He et al.'s standard MAE has none
        standard = all(w == (1.0, 1.0) for w in self.shortcut.weights(2 * depth, transformer_sublayer_types(depth)))
        if zero_init_branches is None:
            zero_init_branches = unet_skips or not standard
        zero_init_branches = bool(zero_init_branches)
        encoder_final_norm = (not unet_skips) if encoder_final_norm is None else bool(encoder_final_norm)
        self.save_hyperparameters(ignore=["shortcut"])
        self.hparams["shortcut"] = self.shortcut.as_dict()  # plain data: weights_only-safe checkpoints
        # the resolved layout, so a checkpoint rebuilds the same network if the defaults change
        self.hparams["zero_init_branches"] = zero_init_branches
        self.hparams["encoder_final_norm"] = encoder_final_norm

        self.encoder = DecayedVisionTransformer(
            shortcut=self.shortcut, zero_init_branches=False,
            img_size=image_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim, depth=depth,
            num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=True, class_token=True, global_pool="",
            num_classes=0, final_norm=encoder_final_norm)
        # MAE's initialisation replaces timm's (trunc-normal 0.02 linears, cls token 1e-6)
        init_linear_and_norm_(self.encoder)
        init_patch_embed_(self.encoder.patch_embed.proj)
        with torch.no_grad():  # fixed sin-cos position embedding, cls position = 0
            nn.init.normal_(self.encoder.cls_token, std=0.02)
            self.encoder.pos_embed.copy_(sincos_pos_embed_2d(embed_dim, grid, cls_token=True).unsqueeze(0))
        self.encoder.pos_embed.requires_grad_(False)
        if zero_init_branches:
            zero_branch_ends_(self.encoder.blocks)

        num_patches = grid * grid
        patch_dim = patch_size * patch_size * in_chans
        if unet_skips:
            self.decoder: nn.Module = UNetSkipDecoder(
                num_patches, embed_dim, depth, decoder_embed_dim, decoder_depth, decoder_num_heads, mlp_ratio, patch_dim,
                zero_init=zero_init_branches)
        else:
            self.decoder = ClassicDecoder(
                num_patches, embed_dim, decoder_embed_dim, decoder_depth, decoder_num_heads, mlp_ratio, patch_dim,
                zero_init=zero_init_branches)
        self.num_features = embed_dim
        self.val_loss_mean = MeanMetric()  # each validation image once, also under DDP
        self._val_images: Optional[torch.Tensor] = None

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
        return tokens[:, 0] if self.hparams.feature_pool == "cls" else tokens.mean(dim=1)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Evaluation features ``B x D``: mean over all tokens (or cls) of the last block."""
        return self.pool_features(self.encode(images)[0])

    def forward_intermediates(self, images: torch.Tensor, indices: Indices = None, intermediates_only: bool = False):
        """``(forward_features, pooled output of the encoder blocks indices picks)`` from one
        encoder pass (timm's call; :mod:`lightning_mods.evaluation.feature_contract`)."""
        last, outputs = self.encode(images)
        blocks = [self.pool_features(outputs[i]) for i in take_indices(len(outputs), indices)]
        return blocks if intermediates_only else (self.pool_features(last), blocks)

    def forward_patch_features(self, images: torch.Tensor, block: int = -1) -> torch.Tensor:
        """Patch tokens of encoder block ``block`` (Python index; -1 the last) on their grid,
        ``B x H/p x W/p x D`` (the cls token dropped): the paper's pixel-wise embeddings (Fig. 3)."""
        tokens = self.encode(images)[1][block][:, 1:]
        grid = self.hparams.image_size // self.hparams.patch_size
        return tokens.reshape(tokens.shape[0], grid, grid, tokens.shape[-1])

    def predict_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        """``embeddings`` (``forward_features``) and ``labels``, for ``callbacks.reporting.prediction_writer``."""
        images, labels = batch[0], batch[1]
        return {"embeddings": self.forward_features(images), "labels": labels}

    # --- reconstruction --------------------------------------------------------------------
    def forward(self, images: torch.Tensor, mask_ratio: Optional[float] = None, generator: Generators = None):
        """``(loss, predicted patches B x L x p*p*C, mask B x L)``; ``generator``: of the masks, one
        for the batch or one per image (None: the global RNG)."""
        ratio = self.hparams.mask_ratio if mask_ratio is None else mask_ratio
        latent, outputs, mask, ids_restore = self.encode_masked(images, ratio, generator)
        pred = self.decoder(outputs, ids_restore) if self.hparams.unet_skips else self.decoder(latent, ids_restore)
        target = self.reconstruction_target(images)
        loss_mask = torch.ones_like(mask) if self.hparams.get("loss_on_all_patches") else mask
        return self.reconstruction_loss(pred, target, loss_mask), pred, mask

    def reconstruction_target(self, images: torch.Tensor) -> torch.Tensor:
        """Extension point: what the decoder predicts, ``B x L x p*p*C`` in patch order (the
        prediction's width). Default: the patches' pixels, normalised per patch under
        ``norm_pix_loss``."""
        target = patchify(images, self.hparams.patch_size)
        return normalise_patches(target) if self.hparams.norm_pix_loss else target

    def target_to_pixels(self, pred: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """A prediction ``B x L x p*p*C`` back in pixel patches, for the reconstruction picture
        (the inverse of :meth:`reconstruction_target`; ``images`` give the true statistics)."""
        if not self.hparams.norm_pix_loss:
            return pred
        target = patchify(images, self.hparams.patch_size)
        mean = target.mean(dim=-1, keepdim=True)
        std = (target.var(dim=-1, keepdim=True) + 1e-6) ** 0.5
        return pred * std + mean

    def reconstruction_loss(self, pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Extension point: the training and validation loss. ``pred``, ``target``: ``B x L x D``;
        ``mask``: ``B x L``, 1 where a patch counts (the hidden ones; all under
        ``loss_on_all_patches``). Default: mean squared error per patch, averaged over those."""
        return masked_patch_loss(pred, target, mask)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images = batch[0]
        loss, _, _ = self(images)
        # no sync_dist: with on_step it would all_reduce every step; the train loss is this rank's,
        # as in the other families
        # no prog_bar: Lightning reads prog_bar values to the host after every step (a GPU sync);
        # callbacks/reporting/progress_bar.py shows the loss at the logging cadence
        self.log(metric_names.TRAIN_LOSS, loss, on_step=True, on_epoch=True, batch_size=images.shape[0])
        return loss

    def _val_generator(self, batch_idx: int) -> torch.Generator:
        # a fixed mask for the reconstruction picture's batch, no draw from the global RNG
        return torch.Generator(device=self.device).manual_seed(1234 + batch_idx)

    def validation_step(self, batch, batch_idx: int) -> Optional[torch.Tensor]:
        # the images a DDP sampler repeats are left out, the batch means weighted by their images,
        # and each image masked by a generator seeded with its dataset index: the epoch value is
        # the one-process value (a fixed mask per image: comparable between epochs), whatever the
        # world size and batch size
        indices = self.sample_indices(len(batch[0]), batch_idx)
        count, images, indices = self.without_repeats(batch_idx, batch[0], indices)
        loss = None
        if count:
            generators = [torch.Generator(device=self.device).manual_seed(1234 + i) for i in indices.tolist()]
            loss, _, _ = self(images, generator=generators)
            self.val_loss_mean.update(loss, weight=count)
        self.log(metric_names.VAL_LOSS, self.val_loss_mean, prog_bar=True, batch_size=count)
        if batch_idx == 0 and self._val_images is None:
            self._val_images = batch[0][: self.hparams.num_reconstructions].detach()
        return loss

    @torch.no_grad()
    def reconstruct(self, images: torch.Tensor, generator: Optional[torch.Generator] = None):
        """``(masked input, reconstruction with visible patches pasted back)`` in input space."""
        _, pred, mask = self(images, generator=generator)
        p, c = self.hparams.patch_size, self.hparams.in_chans
        target = patchify(images, p)
        pred = self.target_to_pixels(pred, images)
        m = mask.unsqueeze(-1)
        masked = unpatchify(target * (1 - m), p, c)
        pasted = unpatchify(target * (1 - m) + pred * m, p, c)
        return masked, pasted

    def on_validation_epoch_end(self) -> None:
        images, self._val_images = self._val_images, None
        if images is None or self.trainer.sanity_checking or self.hparams.num_reconstructions <= 0:
            return
        masked, recon = self.reconstruct(images, generator=self._val_generator(0))
        dm = getattr(self.trainer, "datamodule", None)
        mean = torch.tensor(getattr(dm, "mean", (0.0,) * images.shape[1]), device=images.device).view(1, -1, 1, 1)
        std = torch.tensor(getattr(dm, "std", (1.0,) * images.shape[1]), device=images.device).view(1, -1, 1, 1)
        rows = [((t * std + mean).clamp(0, 1)).permute(0, 2, 3, 1).float().cpu().numpy()
                for t in (images, masked, recon)]
        tiles = np.stack(rows, axis=1)  # one validation image per row: original, masked, reconstruction
        title = (f"{type(self).__name__} reconstructions, epoch {self.current_epoch}, step {self.global_step}\n"
                 f"validation images, {self.hparams.mask_ratio:.0%} of the patches masked;\n"
                 f"reconstruction: the visible patches pasted back")
        log_picture(self.trainer, "mae/reconstructions", labelled_grid(
            tiles, title, row_labels=[f"val {i}" for i in range(len(tiles))],
            col_labels=["original", "masked input", "reconstruction"]))

    # --- optimisation ---------------------------------------------------------------------
    def configure_optimizers(self):
        peak = scaled_lr(self.hparams.base_lr, global_batch_size(self.trainer))
        # as both MAE repositories (add_weight_decay): only 1-D parameters (norms, biases) and the
        # 0-D learnable alphas go undecayed; the cls and mask tokens are decayed
        groups = param_groups_weight_decay(self, self.hparams.weight_decay, no_decay_name_parts=())
        optimizer = adamw(groups, lr=peak, betas=tuple(self.hparams.betas))
        total = int(self.trainer.estimated_stepping_batches)
        warmup = min(steps_from_epochs(self.trainer, self.hparams.warmup_epochs), max(0, total - 1))
        return {"optimizer": optimizer,
                "lr_scheduler": warmup_cosine_scheduler(optimizer, warmup, total, self.hparams.min_lr_ratio)}
