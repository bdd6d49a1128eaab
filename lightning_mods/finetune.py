"""End-to-end fine-tuning of a pre-trained MAE encoder: the decay paper's Table 1 FT column, run
with MAE's fine-tuning recipe for ViT-B/16 (He et al. 2022, appendix A.3; facebookresearch/mae
``main_finetune.py``) as the defaults.

The network is the pre-trained encoder with its shortcut schedule kept (a decayed encoder
fine-tunes decayed; its shortcut weights come with its weights), global average pooling of the
patch tokens with a LayerNorm after the pool in place of the encoder's final norm, a linear head
initialised with std 2e-5, and stochastic depth. AdamW at ``base_lr`` per 256 samples of global
batch, weight decay on the weight matrices only (not on 1-D parameters, the position embedding
or the cls token), layer-wise learning-rate decay (embedding layer 0, block ``i`` layer
``i + 1``, the head the last; a learnable alpha takes its block's rate) through timm's
``param_groups_layer_decay``, warm-up then cosine per step. Mixup and CutMix with label smoothing
(timm's ``Mixup`` and ``SoftTargetCrossEntropy``); RandAugment and random erasing are the
datamodule's (``rand_augment``, ``random_erasing``); evaluation reports top-1 and top-5, each
image once under DDP.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
from lightning.pytorch import LightningModule
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import param_groups_layer_decay
from torch import nn

from lightning_mods.backbone.vit import DecayedVisionTransformer
from lightning_mods.checkpointing._finished_run import chosen_checkpoint
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.checkpointing.network_settings import load_network, network_config, network_of
from lightning_mods.checkpointing.rebuild import build_module
from lightning_mods.evaluation import metric_names
from lightning_mods.evaluation._input_geometry import check_input_geometry
from lightning_mods.recipe._classification_steps import ClassificationSteps
from lightning_mods.recipe.optim import adamw, global_batch_size, scaled_lr, steps_from_epochs, warmup_cosine_scheduler

MAE_CLASS = "lightning_mods.mae.MaskedAutoencoder"
NEW_PARTS = ("head.", "fc_norm.")  # built here, not pre-trained
FINAL_NORM = "norm."  # the encoder's final norm: with the average pool, the pooled LayerNorm takes its place


def fine_tuning_network(mae: nn.Module, num_classes: int, drop_path_rate: float, head_init_std: float,
                        global_pool: str) -> DecayedVisionTransformer:
    """The MAE's encoder as a classifier: its architecture and shortcut schedule, its weights
    (shortcut weights included), pooled by ``global_pool`` with a LayerNorm after an average
    pool, a new head drawn from a truncated normal of std ``head_init_std``. ``mae``: a
    :class:`~lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT` or a recipe holding one."""
    mae = network_of(mae)
    hp = mae.settings
    network = DecayedVisionTransformer(
        shortcut=mae.shortcut, zero_init_branches=False, img_size=hp["img_size"], patch_size=hp["patch_size"],
        in_chans=hp["in_chans"], embed_dim=hp["embed_dim"], depth=hp["depth"], num_heads=hp["num_heads"],
        mlp_ratio=hp["mlp_ratio"], qkv_bias=True, num_classes=num_classes, global_pool=global_pool,
        fc_norm=global_pool == "avg", drop_path_rate=drop_path_rate)
    dropped = NEW_PARTS + ((FINAL_NORM,) if global_pool == "avg" else ())
    state = {k: v for k, v in mae.encoder.state_dict().items() if not k.startswith(dropped)}
    missing, unexpected = network.load_state_dict(state, strict=False)
    # a new final norm is expected only where the encoder had none (the U-Net-skip MAE's)
    new = NEW_PARTS + (() if any(k.startswith(FINAL_NORM) for k in state) else (FINAL_NORM,))
    not_new = [k for k in missing if not k.startswith(new)]
    if not_new or unexpected:
        raise ValueError(f"fine-tuning: the encoder's weights do not fit the network: missing {not_new[:3]}, "
                         f"unexpected {unexpected[:3]}")
    with torch.no_grad():
        nn.init.trunc_normal_(network.head.weight, std=head_init_std)
        nn.init.zeros_(network.head.bias)
    return network


class FineTuneClassifier(ClassificationSteps, LightningModule):
    """Fine-tune a pre-trained MAE encoder end to end (see the module docstring).

    Args:
        checkpoint: a ``shortcutlab fit`` checkpoint of a ``MaskedAutoencoder`` (converted
            official and timm MAE weights too: ``python -m commands.convert_mae import``), or the
            pre-training's folder: the final checkpoint of its finished fit
            (:mod:`lightning_mods.checkpointing._finished_run`).
        network: without a checkpoint, the MAE to build (``class_path``/``init_args``); with one,
            settings checked against it (``allow_override`` builds them on purpose).
        num_classes: linked from the datamodule by the CLI.
        drop_path_rate: stochastic depth, rising linearly over the blocks.
        head_init_std: std of the head's truncated-normal initialisation.
        base_lr: AdamW's peak rate per 256 samples of global batch (per-device batch x devices x
            nodes x gradient accumulation).
        weight_decay, betas: AdamW.
        layer_decay: the rate of layer ``l`` of ``L`` is ``layer_decay ** (L - l)`` times the peak.
        warmup_epochs: linear warm-up, then cosine per step to ``min_lr``.
        mixup, cutmix: the Beta parameters of timm's Mixup and CutMix (0 and 0: neither).
        mixup_prob, mixup_switch_prob: how often a batch is mixed, and how often by CutMix.
        label_smoothing: of the (mixed) targets.
        global_pool: ``avg`` (the patch tokens, then a LayerNorm) or ``token`` (the cls token).
    """

    def __init__(self, checkpoint: Optional[str] = None, network: Optional[dict] = None, num_classes: int = 1000,
                 drop_path_rate: float = 0.1, head_init_std: float = 2e-5, base_lr: float = 5e-4,
                 weight_decay: float = 0.05, betas: tuple[float, float] = (0.9, 0.999), layer_decay: float = 0.65,
                 warmup_epochs: float = 5.0, min_lr: float = 1e-6, mixup: float = 0.8, cutmix: float = 1.0,
                 mixup_prob: float = 1.0, mixup_switch_prob: float = 0.5, label_smoothing: float = 0.1,
                 global_pool: Literal["avg", "token"] = "avg", allow_override: bool = False) -> None:
        super().__init__()
        checkpoint = chosen_checkpoint(checkpoint, "FineTuneClassifier")
        self.save_hyperparameters(ignore=["network"])
        if "checkpoint" in self.hparams:  # LightningCLI records its config's value, the folder: the file instead
            self.hparams["checkpoint"] = self._hparams_initial["checkpoint"] = checkpoint  # (hparams.yaml too)
        if not 0.0 < layer_decay <= 1.0:
            raise ValueError(f"FineTuneClassifier: layer_decay must be in (0, 1], got {layer_decay}")
        if min(mixup, cutmix, label_smoothing, drop_path_rate) < 0 or not 0.0 <= mixup_prob <= 1.0:
            raise ValueError("FineTuneClassifier: mixup, cutmix, label_smoothing and drop_path_rate must be >= 0 and "
                             f"mixup_prob in [0, 1], got {mixup}, {cutmix}, {label_smoothing}, {drop_path_rate}, "
                             f"{mixup_prob}")
        if checkpoint is not None:
            mae, config = load_network(checkpoint, network, allow_override, name="network")
        elif isinstance(network, dict) and network.get("class_path"):
            mae, config = build_module(network)
            mae, config = network_of(mae), network_config(mae, config)
        else:
            raise ValueError("FineTuneClassifier: give checkpoint (a MaskedAutoencoder .ckpt of `shortcutlab fit`), "
                             "or a network to build (class_path and init_args)")
        if not isinstance(mae, MaskedAutoencoderViT):
            raise ValueError(f"FineTuneClassifier: {checkpoint or 'network'} is a {config.get('class_path')}, not a "
                             f"{MAE_CLASS}: fine-tuning starts from a pre-trained MAE")
        self.hparams["network"] = config  # plain data: the checkpoint says which network it fine-tuned
        self.network = fine_tuning_network(mae, num_classes, drop_path_rate, head_init_std, global_pool)
        self.num_features = int(self.network.num_features)
        self.init_accuracies(num_classes)
        mixing = mixup > 0 or cutmix > 0
        self.mixup = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, prob=mixup_prob, switch_prob=mixup_switch_prob,
                           mode="batch", label_smoothing=label_smoothing, num_classes=num_classes) if mixing else None
        self.criterion: nn.Module = SoftTargetCrossEntropy() if mixing else (
            LabelSmoothingCrossEntropy(label_smoothing) if label_smoothing > 0 else nn.CrossEntropyLoss())

    def setup(self, stage: str) -> None:
        check_input_geometry(self.network, getattr(self.trainer, "datamodule", None), "FineTuneClassifier")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.network(images)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Evaluation features ``B x D``: the pooled, normalised input of the head."""
        return self.network.forward_head(self.network.forward_features(images), pre_logits=True)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch[0], batch[1]
        targets = labels
        if self.mixup is not None:
            if len(images) % 2:
                raise ValueError(f"FineTuneClassifier: mixup needs an even batch, got {len(images)} images "
                                 "(set data.batch_size even; the datamodule drops the last incomplete batch)")
            images, targets = self.mixup(images, labels)  # numpy's global RNG: restored on resume
        loss = self.criterion(self(images), targets)
        self.log(metric_names.TRAIN_LOSS, loss, on_step=True, on_epoch=True, batch_size=len(images))
        return loss

    def parameter_groups(self, peak_lr: float) -> list[dict]:
        """timm's ``param_groups_layer_decay`` of the network (MAE's ``param_groups_lrd``): each
        group's ``lr`` is its ``lr_scale`` times ``peak_lr``."""
        groups = param_groups_layer_decay(self.network, self.hparams.weight_decay,
                                          no_weight_decay_list=list(self.network.no_weight_decay()),
                                          layer_decay=self.hparams.layer_decay)
        for group in groups:
            group["lr"] = peak_lr * group["lr_scale"]
        return groups

    def configure_optimizers(self):
        peak = scaled_lr(self.hparams.base_lr, global_batch_size(self.trainer))
        optimizer = adamw(self.parameter_groups(peak), lr=peak, betas=tuple(self.hparams.betas))
        total = int(self.trainer.estimated_stepping_batches)
        warmup = min(steps_from_epochs(self.trainer, self.hparams.warmup_epochs), max(0, total - 1))
        floor = self.hparams.min_lr / peak if peak > 0 else 0.0
        return {"optimizer": optimizer, "lr_scheduler": warmup_cosine_scheduler(optimizer, warmup, total, floor)}
