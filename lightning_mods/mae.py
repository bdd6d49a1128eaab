"""Masked autoencoder pre-training with decayed identity shortcuts (the decay paper, section 4):
the network of :mod:`lightning_mods.backbone.masked_autoencoder` (encoder, decoder with U-Net skips, masking,
loss) with its training recipe: AdamW with MAE's weight-decay groups, the peak rate scaled with
the global batch, warm-up then cosine, the validation loss over each image once, and the
reconstruction picture.

Extension points (the methods a subclass overrides; ``docs/extending.md``, ``examples/``):

- :meth:`MaskedAutoencoder.mask_patches`: which patches are visible.
- :meth:`MaskedAutoencoder.reconstruction_target`: what the decoder predicts for each patch
  (and :meth:`MaskedAutoencoder.target_to_pixels`, its inverse for the reconstruction picture).
- :meth:`MaskedAutoencoder.reconstruction_loss`: the loss of a prediction against the target.
- :meth:`MaskedAutoencoder.pool_features`: the evaluation features from the encoder's tokens.
"""
from __future__ import annotations

from typing import Literal, Optional

import numpy as np
import torch
from jsonargparse import lazy_instance
from lightning.pytorch import LightningModule
from torchmetrics import MeanMetric

from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.evaluation import metric_names
from lightning_mods.evaluation._distributed_eval import ExactEvaluation
from lightning_mods.pictures.grids import labelled_grid, log_picture
from lightning_mods.recipe.optim import (adamw, global_batch_size, param_groups_weight_decay, scaled_lr,
                                           steps_from_epochs, warmup_cosine_scheduler)


class MaskedAutoencoder(ExactEvaluation, MaskedAutoencoderViT, LightningModule):
    """MAE pre-training with decayed shortcuts; defaults follow the paper's recipe (ViT-B/16).

    The network is :class:`~lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT` (its methods and
    weight names); this class adds the recipe.

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
        super().__init__(build=False)  # LightningModule's too; the network is built here from the arguments
        shortcut = ShortcutSchedule.coerce(shortcut, ShortcutSchedule("linear", 0.6))
        self.build_network(image_size, in_chans, patch_size, embed_dim, depth, num_heads, mlp_ratio, shortcut,
                           zero_init_branches, encoder_final_norm, decoder_embed_dim, decoder_depth, decoder_num_heads,
                           unet_skips, norm_pix_loss, mask_ratio, loss_on_all_patches, feature_pool)
        self.save_hyperparameters(ignore=["shortcut"])
        self.hparams["shortcut"] = shortcut.as_dict()  # plain data: weights_only-safe checkpoints
        # the resolved layout, so a checkpoint rebuilds the same network if the defaults change
        self.hparams["zero_init_branches"] = self.zero_init_branches
        self.hparams["encoder_final_norm"] = self.encoder_final_norm
        self.val_loss_mean = MeanMetric()  # each validation image once, also under DDP
        self._val_images: Optional[torch.Tensor] = None

    def forward_intermediates(self, images: torch.Tensor, indices=None, intermediates_only: bool = False):  # noqa: ANN001
        """The evaluations' call (:mod:`lightning_mods.evaluation.feature_contract`): ``(forward_features,
        pooled output of the encoder blocks indices picks)``, read through the network's timm
        ``forward_intermediates`` (:meth:`MaskedAutoencoderViT.pooled_intermediates`)."""
        return self.pooled_intermediates(images, indices, intermediates_only)

    def predict_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        """``embeddings`` (``forward_features``) and ``labels``, for ``callbacks.reporting.prediction_writer``."""
        images, labels = batch[0], batch[1]
        return {"embeddings": self.forward_features(images), "labels": labels}

    # --- the recipe ------------------------------------------------------------------------
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
