"""Masked autoencoder pre-training with decayed identity shortcuts (the decay paper, section 4):
the training recipe of a :class:`~lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT`
(encoder, decoder with U-Net skips, masking, loss), which it holds as ``network``: AdamW with
MAE's weight-decay groups, the peak rate scaled with the global batch, warm-up then cosine, the
validation loss over each image once, and the reconstruction picture.

The network is given as a config ``class_path``/``init_args``, a registered timm name
(``mae_vit_base_patch16_decayed``) or a module. Its extension points (which patches are visible,
the target, the loss, the evaluation features) are methods of the network: a subclass of
``MaskedAutoencoderViT`` given as ``network`` changes them (``docs/extending.md``, ``examples/``).
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torchmetrics import MeanMetric

from lightning_mods.backbone.masked_autoencoder import Generators, Indices, MaskedAutoencoderViT
from lightning_mods.evaluation import metric_names
from lightning_mods.evaluation._distributed_eval import ExactEvaluation
from lightning_mods.evaluation._input_geometry import check_input_geometry
from lightning_mods.pictures.grids import labelled_grid, log_picture
from lightning_mods.checkpointing.earlier_releases import ReadsEarlierReleases
from lightning_mods.checkpointing.network_settings import given_network, network_settings
from lightning_mods.recipe.optim import (adamw, global_batch_size, param_groups_weight_decay, scaled_lr,
                                           steps_from_epochs, warmup_cosine_scheduler)


class MaskedAutoencoder(ReadsEarlierReleases, ExactEvaluation, LightningModule):
    """MAE pre-training of ``network`` with decayed shortcuts; defaults follow the paper's recipe.

    Args:
        network: the :class:`~lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT` to
            train (its architecture, shortcut schedule, masking and loss): ``class_path``/``init_args``
            in a config (``img_size`` and ``in_chans`` linked from the datamodule's ``image_size`` and ``in_chans``),
            a registered timm name, or a module.
        base_lr: learning rate per 256 samples of GLOBAL batch (peak = base_lr * batch / 256).
        weight_decay, betas: AdamW; no decay on 1-D parameters (norms, biases) and learnable
            alphas; the cls and mask tokens are decayed, as in both MAE repositories.
        warmup_epochs: linear per-step warm-up, then cosine to ``min_lr_ratio * peak``.
        num_reconstructions: validation images drawn (original / masked / reconstruction).
    """

    network_is_evaluated = True  # the probe, kNN and fine-tuning read the network alone

    def __init__(
        self,
        network: Union[MaskedAutoencoderViT, str],
        base_lr: float = 1.5e-4,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_epochs: float = 40.0,
        min_lr_ratio: float = 0.0,
        num_reconstructions: int = 8,
    ) -> None:
        super().__init__()
        self.network = given_network(network, MaskedAutoencoderViT, "MaskedAutoencoder", "mae_vit_base_patch16_decayed")
        self.save_hyperparameters(ignore=["network"])
        # the resolved settings of the network (plain data), so a checkpoint rebuilds this very network
        self.hparams["network"] = self._hparams_initial["network"] = network_settings(self.network)
        self.val_loss_mean = MeanMetric()  # each validation image once, also under DDP
        self._val_images: Optional[torch.Tensor] = None

    # --- the network ------------------------------------------------------------------------
    def forward(self, images: torch.Tensor, mask_ratio: Optional[float] = None, generator: Generators = None):
        """The network's ``(loss, predicted patches, mask)``."""
        return self.network(images, mask_ratio, generator)

    @property
    def num_features(self) -> int:
        return self.network.num_features

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """The network's evaluation features ``B x D``."""
        return self.network.forward_features(images)

    def forward_intermediates(self, images: torch.Tensor, indices: Indices = None, intermediates_only: bool = False):
        """The evaluations' call (:mod:`lightning_mods.evaluation.feature_contract`): ``(forward_features,
        pooled output of the encoder blocks indices picks)``, read through the network's timm
        ``forward_intermediates`` (:meth:`MaskedAutoencoderViT.pooled_intermediates`)."""
        return self.network.pooled_intermediates(images, indices, intermediates_only)

    def forward_patch_features(self, images: torch.Tensor, block: int = -1) -> torch.Tensor:
        """The network's patch tokens of encoder block ``block`` on their grid, ``B x H/p x W/p x D``."""
        return self.network.forward_patch_features(images, block)

    def setup(self, stage: str) -> None:
        check_input_geometry(self.network, getattr(self.trainer, "datamodule", None), "MaskedAutoencoder",
                             "give the network the data's image size and channels, or data of the network's")

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
            loss, _, _ = self.network(images, generator=generators)
            self.val_loss_mean.update(loss, weight=count)
        self.log(metric_names.VAL_LOSS, self.val_loss_mean, prog_bar=True, batch_size=count)
        if batch_idx == 0 and self._val_images is None:
            self._val_images = batch[0][: self.hparams.num_reconstructions].detach()
        return loss

    def on_validation_epoch_end(self) -> None:
        images, self._val_images = self._val_images, None
        if images is None or self.trainer.sanity_checking or self.hparams.num_reconstructions <= 0:
            return
        masked, recon = self.network.reconstruct(images, generator=self._val_generator(0))
        dm = getattr(self.trainer, "datamodule", None)
        mean = torch.tensor(getattr(dm, "mean", (0.0,) * images.shape[1]), device=images.device).view(1, -1, 1, 1)
        std = torch.tensor(getattr(dm, "std", (1.0,) * images.shape[1]), device=images.device).view(1, -1, 1, 1)
        rows = [((t * std + mean).clamp(0, 1)).permute(0, 2, 3, 1).float().cpu().numpy()
                for t in (images, masked, recon)]
        tiles = np.stack(rows, axis=1)  # one validation image per row: original, masked, reconstruction
        title = (f"{type(self).__name__} reconstructions, epoch {self.current_epoch}, step {self.global_step}\n"
                 f"validation images, {self.network.mask_ratio:.0%} of the patches masked;\n"
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
