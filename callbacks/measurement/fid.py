"""Generation quality at validation: FID (and KID, IS) of samples of the diffusion model against
the dataset (the decay paper, section 5; metrics in :mod:`lightning_mods._generation.fidelity_metrics`).

Runs every ``every_n_epochs`` validation epochs of ``fit`` (None: every validation), after the
last epoch of ``fit``, and at every ``validate`` (e.g.
``shortcutlab validate --config ... --ckpt_path ...``). It runs when the first validation batch
starts: by then every ``on_validation_epoch_start`` hook has run, so Lightning's
``EMAWeightAveraging`` has swapped the averaged weights in, whatever the callback order.
Rank 0 generates and measures; the values are broadcast and logged on every rank as
``val/fid``, ``val/kid_mean``, ``val/isc_mean`` ...

U-ViT's checkpoint choice (``train.py``): during ``fit`` a cheap FID (10k samples, 50 DPM-Solver
steps) scores every saved checkpoint; a ``ModelCheckpoint(monitor="val/fid", mode="min")`` keeps
them and names the best. The reported number is a ``validate`` run of that checkpoint with
``report_num_samples`` (50k) drawn by the model's own sampler (or ``report_sampler``).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Literal, Optional, Sequence

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer

from datamodules.base import check_positive
from lightning_mods._generation.fidelity_metrics import GeneratedImages, UInt8Images, generation_metrics, subset_indices
from lightning_mods.evaluation import metric_names
from callbacks._utils.distributed import log_identical
from callbacks.schedule import ScheduledEvaluation, check_every_n_epochs, evaluation_due
from callbacks.cost import PER_VALIDATION


# datamodule settings that change how images are loaded, never which images or their pixels
_LOADER_ONLY = frozenset({"batch_size", "eval_batch_size", "num_workers", "pin_memory", "persistent_workers",
                          "drop_last_train", "train_augmentation", "horizontal_flip", "crop_scale", "download"})


def reference_fingerprint(datamodule: Any, indices: Optional[Sequence[int]]) -> str:
    """Eight hex digits of the settings that decide the reference pixels (data folder, class
    list, crop ratio, ...) and of the chosen subset, so that two references of the same class,
    size and count never share cached statistics."""
    hparams = getattr(datamodule, "hparams", {}) or {}
    settings = {k: v for k, v in dict(hparams).items() if k not in _LOADER_ONLY}
    text = json.dumps({"settings": settings, "indices": None if indices is None else [int(i) for i in indices]},
                      sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:8]


class GenerationMetrics(ScheduledEvaluation):
    """FID/KID/IS of ``num_samples`` generated images against a reference split.

    The model provides ``generate_images(n, labels, seed=..., ...)`` and ``grid_labels(n, start)``
    (``lightning_mods.diffusion.DiffusionModule`` does).

    Args:
        num_samples: images generated per evaluation (the paper: 50000).
        every_n_epochs: evaluate at validation epochs whose ``(epoch + 1)`` is a multiple (and
            the last epoch of ``fit``); None: at every validation (``trainer.check_val_every_n_epoch``).
        on_validate: also evaluate in ``validate`` runs.
        batch_size: images generated per sampling batch.
        reference: datamodule of the reference images (None: the trainer's datamodule; needed
            in latent mode, whose datamodule holds latents).
        reference_split: ``train`` (its eval-transform copy, the kNN bank) or ``val``.
        num_reference: a fixed random subset of the reference split (None: all of it).
        reference_cache_name: torch-fidelity's cache name for the reference statistics (None:
            made from the datamodule class, split, image size, number of images and a hash of
            the datamodule settings that decide the pixels, see :func:`reference_fingerprint`).
        cache_root: folder of the cached statistics (None: ``<default_root_dir>/fid_cache``).
        feature_extractor: torch-fidelity extractor name; ``feature_extractor_weights_path``:
            its weights file (Inception: ``pt_inception-2015-12-05-6726825d.pth``).
        kid, isc: also compute KID and IS (when the extractor provides them).
        kid_subset_size: KID subset size (capped by the number of images).
        sampler, num_sampling_steps, guidance_scale: override the model's sampling settings.
        report_num_samples: set: ``validate`` runs draw this many images with
            ``report_sampler``/``report_num_sampling_steps`` (None: the model's own) instead of the
            ``fit`` settings above; None: ``validate`` uses the ``fit`` settings.
        seed: seed of the first sampling batch (batch ``i`` uses ``seed + i``).
    """
    cost = PER_VALIDATION

    def __init__(
        self,
        num_samples: int = 10000,
        every_n_epochs: Optional[int] = None,
        on_validate: bool = True,
        batch_size: int = 250,
        reference: Optional[LightningDataModule] = None,
        reference_split: Literal["train", "val"] = "train",
        num_reference: Optional[int] = None,
        reference_cache_name: Optional[str] = None,
        cache_root: Optional[str] = None,
        feature_extractor: str = "inception-v3-compat",
        feature_extractor_weights_path: Optional[str] = None,
        kid: bool = True,
        isc: bool = True,
        kid_subset_size: int = 1000,
        sampler: Optional[str] = None,
        num_sampling_steps: Optional[int] = None,
        guidance_scale: Optional[float] = None,
        report_num_samples: Optional[int] = None,
        report_sampler: Optional[str] = None,
        report_num_sampling_steps: Optional[int] = None,
        seed: int = 0,
    ) -> None:
        check_positive("GenerationMetrics", num_samples=num_samples, batch_size=batch_size,
                       kid_subset_size=kid_subset_size)
        if report_num_samples is not None:
            check_positive("GenerationMetrics", report_num_samples=report_num_samples)
        every_n_epochs = check_every_n_epochs("GenerationMetrics", every_n_epochs)
        if reference_split not in ("train", "val"):
            raise ValueError(f"reference_split must be 'train' or 'val', got {reference_split!r}")
        self.num_samples = num_samples
        self.every_n_epochs = every_n_epochs
        self.on_validate = on_validate
        self.batch_size = batch_size
        self.reference = reference
        self.reference_split = reference_split
        self.num_reference = num_reference
        self.reference_cache_name = reference_cache_name
        self.cache_root = cache_root
        self.feature_extractor = feature_extractor
        self.feature_extractor_weights_path = feature_extractor_weights_path
        self.kid = kid
        self.isc = isc
        self.kid_subset_size = kid_subset_size
        self.sampler = sampler
        self.num_sampling_steps = num_sampling_steps
        self.guidance_scale = guidance_scale
        self.report_num_samples = report_num_samples
        self.report_sampler = report_sampler
        self.report_num_sampling_steps = report_num_sampling_steps
        self.seed = seed
        self.last_metrics: dict[str, float] = {}

    # --- when --------------------------------------------------------------------------------
    def should_run(self, trainer: Trainer) -> bool:
        if trainer.state.fn == "validate" and not trainer.sanity_checking:
            return self.on_validate
        return trainer.state.fn == "fit" and evaluation_due(trainer, self.every_n_epochs)

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx != 0 or dataloader_idx != 0 or not self.should_run(trainer):
            return
        metrics = self.evaluate(trainer, pl_module) if trainer.is_global_zero else {}
        metrics = trainer.strategy.broadcast(metrics, src=0)
        self.last_metrics = dict(metrics)
        log_identical(pl_module, {metric_names.generation_metric(name): value for name, value in metrics.items()},
                      batch_size=1)

    # --- what --------------------------------------------------------------------------------
    def reference_images(self, trainer: Trainer, pl_module: LightningModule) -> tuple[UInt8Images, str]:
        """The reference split as uint8 images and its cache name."""
        datamodule = self.reference if self.reference is not None else trainer.datamodule
        if self.reference is None and getattr(pl_module, "is_latent", False):
            raise ValueError("reference: the model is in latent mode and its datamodule holds latents; "
                             "give an image datamodule (e.g. datamodules.imagenet.ImageNet) as reference")
        if datamodule is None or not hasattr(datamodule, "mean"):
            raise ValueError("reference: needs an image datamodule with mean/std (datamodules.base.ImageDataModule)")
        if self.reference_split == "train":
            if getattr(datamodule, "bank_dataset", None) is None:
                datamodule.setup("fit")
            split = datamodule.bank_dataset
        else:
            if getattr(datamodule, "val_dataset", None) is None:
                datamodule.setup("validate")
            split = datamodule.val_dataset
        indices = subset_indices(len(split), self.num_reference)
        images = UInt8Images(split, datamodule.mean, datamodule.std, indices)
        name = self.reference_cache_name or (
            f"{type(datamodule).__name__}-{self.reference_split}-{datamodule.image_size}px-n{len(images)}-"
            f"{reference_fingerprint(datamodule, indices)}")
        return images, name

    def sampling_settings(self, trainer: Trainer) -> tuple[int, Optional[str], Optional[int]]:
        """``(num_samples, sampler, num_sampling_steps)`` of this run: the report settings in
        ``validate`` when ``report_num_samples`` is set, else the ``fit`` ones."""
        if trainer.state.fn == "validate" and self.report_num_samples is not None:
            return self.report_num_samples, self.report_sampler, self.report_num_sampling_steps
        return self.num_samples, self.sampler, self.num_sampling_steps

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        """Generate images and measure them against the reference."""
        reference, cache_name = self.reference_images(trainer, pl_module)
        num_samples, sampler, num_steps = self.sampling_settings(trainer)

        def generate(batch_index: int, size: int) -> torch.Tensor:
            labels = pl_module.grid_labels(size, start=batch_index * self.batch_size)  # balanced over the set
            return pl_module.generate_images(size, labels, seed=self.seed + batch_index, sampler=sampler,
                                             num_steps=num_steps, guidance_scale=self.guidance_scale)

        generated = GeneratedImages(generate, num_samples, self.batch_size)
        cache_root = self.cache_root or os.path.join(trainer.default_root_dir, "fid_cache")
        return generation_metrics(
            generated, reference, cache_name, cache_root, feature_extractor=self.feature_extractor,
            feature_extractor_weights_path=self.feature_extractor_weights_path, kid=self.kid, isc=self.isc,
            kid_subset_size=self.kid_subset_size, cuda=pl_module.device.type == "cuda")
