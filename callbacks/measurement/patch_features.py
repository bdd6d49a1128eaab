"""The patch-feature picture at every evaluation (the decay paper's Figure 3, DINO's
PCA view): for the first ``num_images`` validation images, block ``block``'s patch tokens (a
ResNet's spatial map) projected on their joint top three principal components, drawn as RGB
beside the input (:mod:`lightning_mods.pictures._patch_pca`). The same images every time, so the pictures
of a run show how the embeddings change. ``shortcutlab features`` draws it for any checkpoint.
"""
from __future__ import annotations

from typing import Optional

import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_mods.evaluation._eval_mode import isolated_eval
from lightning_mods.pictures._patch_pca import images_for_display, patch_feature_figure, patch_rgb
from lightning_mods.pictures.grids import log_picture
from callbacks._utils.feature_collection import datamodule_dataset
from callbacks.schedule import ScheduledEvaluation, check_every_n_epochs, evaluation_due
from callbacks.cost import PER_VALIDATION


class PatchFeaturePicture(ScheduledEvaluation):
    """Log ``features/patch_pca`` after validation epochs (every ``every_n_epochs``-th of ``fit``,
    the last one, and every ``validate``; global rank 0 computes and draws it).

    Args:
        num_images: the first validation images drawn (one row each).
        block: the block whose patch tokens are drawn (Python index: -1 is the last).
        every_n_epochs: None: at every validation (``trainer.check_val_every_n_epoch``).
    """
    cost = PER_VALIDATION

    def __init__(self, num_images: int = 8, block: int = -1, every_n_epochs: Optional[int] = None) -> None:
        super().__init__()
        if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 1:
            raise ValueError(f"PatchFeaturePicture: num_images must be an integer >= 1, got {num_images!r}")
        if isinstance(block, bool) or not isinstance(block, int):
            raise ValueError(f"PatchFeaturePicture: block must be an integer (-1: the last), got {block!r}")
        self.num_images = num_images
        self.block = block
        self.every_n_epochs = check_every_n_epochs("PatchFeaturePicture", every_n_epochs)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not hasattr(pl_module, "forward_patch_features"):
            raise ValueError(f"PatchFeaturePicture: needs {type(pl_module).__name__}.forward_patch_features "
                             "(docs/contracts.md: the MAE and the classifiers have it)")

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not evaluation_due(trainer, self.every_n_epochs) or not trainer.is_global_zero:
            return
        dataset = datamodule_dataset(trainer, "val_dataset", "PatchFeaturePicture")
        images = torch.stack([torch.as_tensor(dataset[i][0]) for i in range(min(self.num_images, len(dataset)))])
        with isolated_eval(pl_module), trainer.precision_plugin.forward_context():
            features = pl_module.forward_patch_features(images.to(pl_module.device), self.block)
        dm = trainer.datamodule
        shown = images_for_display(images, getattr(dm, "mean", (0.0,) * images.shape[1]),
                                   getattr(dm, "std", (1.0,) * images.shape[1]))
        block = "last block" if self.block == -1 else f"block {self.block + 1 if self.block >= 0 else self.block}"
        title = (f"{type(pl_module).__name__} patch features, {block}, epoch {trainer.current_epoch}, step "
                 f"{trainer.global_step}\ntop-3 principal components over these {len(images)} validation images as RGB")
        log_picture(trainer, "features/patch_pca",
                    patch_feature_figure(shown, patch_rgb(features.float().cpu()).numpy(), title))
