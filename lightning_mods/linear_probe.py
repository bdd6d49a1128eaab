"""Offline linear probe (the decay paper, section 4, evaluation protocol): a frozen pre-trained backbone,
a linear head (after a BatchNorm without affine parameters, as MAE's probe) trained without
augmentation, SGD with cosine decay to 0.

Two entry points: :class:`LinearProbe`, a LightningModule that rebuilds the network a
``shortcutlab fit`` checkpoint was written by (class, architecture, shortcut schedule and
weights all come from the checkpoint, read with ``torch.load(weights_only=True)``: no arbitrary
pickle) and trains on image batches; and :func:`train_linear_probe_on_features` for features
already extracted (e.g. the diffusion feature sweep).
"""
from __future__ import annotations

import math
from typing import Literal, Optional, Union

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics.functional.classification import multiclass_accuracy

from lightning_mods.recipe._classification_steps import ClassificationSteps
from lightning_mods.checkpointing._finished_run import chosen_checkpoint
from lightning_mods.checkpointing.network_settings import load_network, network_config, network_of
from lightning_mods.checkpointing.rebuild import build_module, load_checkpoint_state_dict, load_into
from lightning_mods.recipe.optim import (global_batch_size, lars, scaled_lr, steps_from_epochs, warmup_cosine,
                                          warmup_cosine_scheduler)
from lightning_mods.evaluation._probe_head import ProbeHead
from lightning_mods.evaluation import metric_names
from lightning_mods.recipe._classification_steps import top_k_accuracy
from lightning_mods.evaluation.feature_contract import block_features, features_and_blocks, require_blocks, require_features
from lightning_mods.evaluation._input_geometry import check_input_geometry, network_geometry
from lightning_mods.evaluation.over_depth import DepthRows, check_blocks, resolve_blocks, write_pending


def block_widths(backbone: nn.Module) -> list[int]:
    """The width of every block's pooled output (the feature contract's block features), from one
    example image of the backbone's input geometry (32-pixel RGB where it takes any)."""
    require_blocks(backbone, "LinearProbe: blocks")
    size, chans = network_geometry(backbone)
    example = torch.zeros(1, chans or 3, size or 32, size or 32)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        training = backbone.training
        backbone.eval()
        outputs = block_features(backbone, example)
        backbone.train(training)
    return [int(o.shape[-1]) for o in outputs]


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Fraction of rows whose label is among the ``k`` highest logits (``k`` capped at the number
    of classes), through torchmetrics' micro-averaged ``multiclass_accuracy``."""
    num_classes = logits.shape[1]
    return multiclass_accuracy(logits, labels, num_classes, average="micro", top_k=min(k, num_classes)).item()


def train_linear_probe_on_features(
    train_features: torch.Tensor, train_labels: torch.Tensor,
    val_features: torch.Tensor, val_labels: torch.Tensor, num_classes: int,
    epochs: int = 100, lr: float = 1e-2, batch_size: int = 1024, weight_decay: float = 0.0,
    momentum: float = 0.9, batch_norm: bool = True, seed: int = 0,
) -> dict[str, float]:
    """Train a linear probe on precomputed features; returns ``{"top1", "top5"}`` on val (0..1)."""
    if epochs <= 0 or batch_size <= 0:
        raise ValueError(f"epochs and batch_size must be positive, got epochs={epochs}, batch_size={batch_size}")
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = ProbeHead(train_features.shape[1], num_classes, batch_norm).to(train_features.device)
    opt = torch.optim.SGD(head.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    n = train_features.shape[0]
    steps_per_epoch = math.ceil(n / batch_size)
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, 0, total))
    x, y = train_features.float(), train_labels.long()
    head.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).to(x.device)
        for i in range(steps_per_epoch):
            idx = order[i * batch_size:(i + 1) * batch_size]
            if batch_norm and idx.numel() < 2:
                continue  # BatchNorm needs two samples
            loss = F.cross_entropy(head(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    head.eval()
    with torch.no_grad():
        logits = head(val_features.float())
    return {"top1": topk_accuracy(logits, val_labels.long(), 1), "top5": topk_accuracy(logits, val_labels.long(), 5)}


def set_feature_pool(backbone: nn.Module, feature_pool: str) -> None:
    """Make an MAE network pool its features as ``feature_pool`` (what the probe reads, not the
    weights; the probe's own ``feature_pool`` setting records it)."""
    if not hasattr(backbone, "feature_pool"):
        raise ValueError(f"LinearProbe: feature_pool needs a backbone with that setting (the MAE); "
                         f"{type(backbone).__name__} has none")
    backbone.feature_pool = feature_pool


class LinearProbe(ClassificationSteps, LightningModule):
    """Linear probe of a frozen backbone loaded from a ``shortcutlab fit`` checkpoint.

    Args:
        backbone: optional settings in LightningCLI's ``class_path``/``init_args`` form, checked
            against the checkpoint: one that disagrees is a one-line error naming both values.
            Without a checkpoint, the full configuration to build (or, from Python, a built
            LightningModule). It must provide ``forward_features(images) -> B x D`` and ``num_features``.
        checkpoint: path of the pre-training checkpoint, or the pre-training's folder (its
            ``trainer.default_root_dir`` or sweep run): the final checkpoint of its finished fit,
            whatever version wrote it (:mod:`lightning_mods.checkpointing._finished_run`). The
            backbone is the network that wrote it: class, architecture and shortcut schedule come
            from its hyper-parameters, the weights (resolved shortcut weights included) from its
            state_dict.
        allow_override: build with the given ``backbone`` settings where they disagree
            with the checkpoint (a warning says so), on purpose.
        num_classes: linked from the datamodule by the CLI.
        lr: peak learning rate (the decay paper: 1e-2 at batch 1024), cosine to 0 over the run;
            with ``reference_batch``, the rate per that many samples of global batch (MAE's
            ImageNet-1K probe: 0.1 per 256).
        optimizer: ``sgd`` (momentum; the decay paper's ImageNet-100 protocol) or ``lars`` (MAE's
            ImageNet-1K protocol: the trust ratio on the weights only, no weight decay).
        reference_batch: the batch ``lr`` is given for (linear scaling to the global batch:
            per-device batch x devices x nodes x accumulation); ``None``: ``lr`` as it is.
        feature_pool: the features the probe reads, ``cls`` (MAE's ``--cls_token``) or ``mean`` of
            the tokens, for a backbone that has the setting (the MAE); ``None``: the backbone's own.
        batch_norm: BatchNorm without affine parameters before the linear layer.
        blocks: also probe every chosen block's pooled output (``"all"`` or a list of indices,
            1 = nearest the input, -1 = the last; the backbone's ``forward_intermediates``): one
            head per block from the same forward pass, trained in the same optimiser step, each
            initialised as a probe of that block alone would be. Each validation writes their
            top-1 and the blocks' feature norms to ``eval_per_block.csv`` and the picture
            ``eval/over_depth`` (:mod:`lightning_mods.evaluation.over_depth`); ``val/top1`` stays the
            ``forward_features`` head's.
    """

    probes_a_network = True  # its checkpoints hold a probe of another network, refused as one to evaluate

    def __init__(self, backbone: Optional[dict] = None, checkpoint: Optional[str] = None,
                 num_classes: int = 1000, lr: float = 1e-2, momentum: float = 0.9, weight_decay: float = 0.0,
                 warmup_epochs: float = 0.0, batch_norm: bool = True, allow_override: bool = False,
                 blocks: Union[None, str, list[int]] = None, optimizer: Literal["sgd", "lars"] = "sgd",
                 reference_batch: Optional[int] = None, feature_pool: Optional[Literal["mean", "cls"]] = None) -> None:
        super().__init__()
        check_blocks("LinearProbe", blocks)
        checkpoint = chosen_checkpoint(checkpoint, "LinearProbe")
        self.save_hyperparameters(ignore=["backbone"])
        if "checkpoint" in self.hparams:  # LightningCLI records its config's value, the folder: the file instead
            self.hparams["checkpoint"] = self._hparams_initial["checkpoint"] = checkpoint  # (hparams.yaml too)
        if isinstance(backbone, nn.Module):
            if checkpoint is not None:
                load_into(backbone, load_checkpoint_state_dict(checkpoint), checkpoint)
            backbone = network_of(backbone)
            config = {"class_path": f"{type(backbone).__module__}.{type(backbone).__qualname__}"}
        elif checkpoint is not None:
            backbone, config = load_network(checkpoint, backbone, allow_override)  # the network alone
        elif isinstance(backbone, dict) and backbone.get("class_path"):
            backbone, config = build_module(backbone)
            backbone, config = network_of(backbone), network_config(backbone, config)
        else:
            raise ValueError("LinearProbe: give checkpoint (a .ckpt of `shortcutlab fit`), or a backbone to probe "
                             "as built (class_path and init_args)")
        # plain data, so a probe checkpoint says which network it probed (weights_only-safe)
        self.hparams["backbone"] = config
        require_features(backbone, "LinearProbe: backbone")
        if optimizer not in ("sgd", "lars"):
            raise ValueError(f"LinearProbe: optimizer must be 'sgd' or 'lars', got {optimizer!r}")
        if optimizer == "lars" and weight_decay:
            raise ValueError(f"LinearProbe: LARS (MAE's ImageNet-1K probe) takes no weight decay, got {weight_decay}")
        if reference_batch is not None and reference_batch < 1:
            raise ValueError(f"LinearProbe: reference_batch must be >= 1 or None, got {reference_batch!r}")
        if feature_pool is not None:
            set_feature_pool(backbone, feature_pool)
        self.backbone = backbone
        self.backbone.requires_grad_(False)
        self.backbone.eval()
        dim = getattr(backbone, "num_features", None)
        if dim is None:
            raise ValueError(f"backbone must expose num_features (its feature width); {type(backbone).__name__} does not")
        self.head = ProbeHead(int(dim), num_classes, batch_norm)
        self.init_accuracies(num_classes)
        self.block_heads = nn.ModuleDict()  # "3" -> the head of block 3
        self.block_top1 = nn.ModuleDict()
        if blocks is not None:
            widths = block_widths(backbone)
            seed = torch.initial_seed()
            for block in resolve_blocks("LinearProbe", blocks, len(widths)):
                with torch.random.fork_rng(devices=[]):  # the global stream stays the single-head probe's
                    self.block_heads[str(block)] = ProbeHead(
                        widths[block - 1], num_classes, batch_norm,
                        generator=torch.Generator().manual_seed(seed + block))  # as a probe of this block alone
                self.block_top1[str(block)] = top_k_accuracy(num_classes, 1)
        self.over_depth = DepthRows()  # per-block rows of fit's validations (in the checkpoint) and the last validate's
        self._block_norms: dict[str, torch.Tensor] = {}  # this validation's feature-norm sums and sample count
        self._block_count = 0

    def setup(self, stage: str) -> None:
        # a backbone that takes its input normalisation from the datamodule (DiffusionModule:
        # pixel mean/std, latent scale and shift) learns it here as it did in pre-training
        datamodule = getattr(self.trainer, "datamodule", None)
        check_input_geometry(self.backbone, datamodule, "LinearProbe")
        if datamodule is not None and hasattr(self.backbone, "set_pixel_stats"):
            self.backbone.set_pixel_stats(datamodule)

    def train(self, mode: bool = True) -> "LinearProbe":
        super().train(mode)
        self.backbone.eval()  # frozen: BatchNorm statistics and dropout stay in eval mode
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = self.backbone.forward_features(images)
        return self.head(features)

    # --- heads over depth (blocks) ----------------------------------------------------------
    def _features_and_blocks(self, images: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.no_grad():
            features, outputs = features_and_blocks(self.backbone, images)
        return features, {key: outputs[int(key) - 1] for key in self.block_heads}

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        if not self.block_heads:
            return super().training_step(batch, batch_idx)
        features, blocks = self._features_and_blocks(batch[0])
        loss = self.train_on_logits(self.head(features), batch[1])
        # the heads are independent: the sum's gradient is each head's own loss gradient
        return loss + sum(F.cross_entropy(self.block_heads[key](f), batch[1]) for key, f in blocks.items())

    def validation_step(self, batch, batch_idx: int) -> None:
        if not self.block_heads:
            return super().validation_step(batch, batch_idx)
        images, labels = batch[0], batch[1]
        features, blocks = self._features_and_blocks(images)  # one backbone pass for every head
        self.evaluate_logits(self.head(features), labels, "val", self.val_top1, self.val_top5, batch_idx)
        real = self.real_samples(len(labels), batch_idx)  # the block heads count each image once too
        if real is not None:
            labels, blocks = labels[real.to(labels.device)], {k: f[real.to(f.device)] for k, f in blocks.items()}
        if not len(labels):
            return
        for key, block_features in blocks.items():
            self.block_top1[key].update(self.block_heads[key](block_features), labels)
            self._block_norms[key] = self._block_norms.get(key, 0.0) + block_features.double().norm(dim=1).sum()
        self._block_count += labels.shape[0]

    def on_validation_epoch_start(self) -> None:
        self._block_norms: dict[str, torch.Tensor] = {}
        self._block_count = 0
        for accuracy in self.block_top1.values():  # the sanity check's batches do not count
            accuracy.reset()

    def on_validation_epoch_end(self) -> None:
        if not self.block_heads or self.trainer.sanity_checking:
            return
        count = self.trainer.strategy.reduce(torch.tensor(float(self._block_count), device=self.device),
                                             reduce_op="sum")
        rows = []
        for key in self.block_heads:
            norm = self.trainer.strategy.reduce(self._block_norms[key].to(self.device), reduce_op="sum")
            rows.append({"epoch": int(self.current_epoch), "step": int(self.global_step), "block": int(key),
                         metric_names.VAL_TOP1: self.block_top1[key].compute().item(),
                         metric_names.FEATURE_NORM: float(norm / count)})
        self.over_depth.record(self.trainer, rows)

    def on_validation_end(self) -> None:
        write_pending(self.trainer, "linear probe over depth")

    def depth_rows(self, trainer) -> list[dict]:  # noqa: ANN001 (Trainer)
        """The per-block rows of ``eval_per_block.csv``: every validation of fit, or the last validate's."""
        return self.over_depth.rows(trainer)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["depth_history"] = [dict(row) for row in self.over_depth.depth_history]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.over_depth.depth_history = [dict(row) for row in checkpoint.get("depth_history", [])]

    def predict_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        """The backbone's ``embeddings``, the probe's ``logits`` and ``labels``, for
        ``callbacks.reporting.prediction_writer``."""
        images, labels = batch[0], batch[1]
        with torch.no_grad():
            features = self.backbone.forward_features(images)
        return {"embeddings": features, "logits": self.head(features), "labels": labels}

    def configure_optimizers(self):
        heads = [*self.head.parameters(), *self.block_heads.parameters()]  # the authors' layout: one step for all
        lr = self.hparams.lr
        if self.hparams.get("reference_batch"):
            lr = scaled_lr(lr, global_batch_size(self.trainer), self.hparams.reference_batch)
        if self.hparams.get("optimizer", "sgd") == "lars":
            optimizer = lars(heads, lr=lr, momentum=self.hparams.momentum)
        else:
            optimizer = torch.optim.SGD(heads, lr=lr, momentum=self.hparams.momentum,
                                        weight_decay=self.hparams.weight_decay)
        total = int(self.trainer.estimated_stepping_batches)
        warmup = min(steps_from_epochs(self.trainer, self.hparams.warmup_epochs), max(0, total - 1))
        return {"optimizer": optimizer, "lr_scheduler": warmup_cosine_scheduler(optimizer, warmup, total)}
