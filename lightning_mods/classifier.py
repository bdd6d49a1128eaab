"""Supervised image classifier over the shortcut-aware networks (the decay paper's appendix B.2 and the ResidualDroppath paper;
"Residual Connections Harm Generative Representation Learning", appendix; "ResidualDroppath",
section 4).

Its ``network`` is any timm-style network configured on its own (``class_path``/``init_args``,
e.g. :class:`~lightning_mods.backbone.resnet.ResNet50` with a
:class:`~lightning_mods.backbone.shortcut.ShortcutSchedule`). The classifier adapts it to the data the
CLI links in: a head of another size is replaced with timm's ``reset_classifier(num_classes)``
and a first convolution that expects another number of channels is rebuilt for ``in_chans``.
A network built with the right ``num_classes``/``in_chans`` is used as it is.

Why adapt an instance rather than take a network factory: the network stays an ordinary
``nn.Module`` in the config (``class_path``/``init_args``, every timm argument visible to
``--help``), and the CLI's ``num_classes``/``in_chans`` links need no knowledge of it.

Recipe defaults are timm's ``train.py`` defaults (the ResidualDroppath paper trains with
them): SGD with Nesterov momentum 0.9, lr 0.1 per 256 samples of global batch, weight decay
2e-5 without decay on norms and biases, 5 warm-up epochs then cosine to 0 (per optimiser step
here, per epoch in timm), label smoothing 0.1. The stochastic-depth baseline is the network's own
``drop_path_rate`` (timm's DropPath with 1/keep rescaling, linear over depth).

SyncBatchNorm is the trainer's job: ``trainer.sync_batchnorm: true`` converts every BatchNorm
when the strategy is DDP (Lightning's ``TorchSyncBatchNorm``); nothing here changes.
"""
from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from lightning_mods.recipe._classification_steps import ClassificationSteps
from lightning_mods.recipe.optim import (adamw, global_batch_size, param_groups_weight_decay, scaled_lr, steps_from_epochs,
                    warmup_cosine_scheduler)
from lightning_mods.backbone.residual import residual_blocks
from lightning_mods.evaluation.feature_contract import Indices, take_indices

OPTIMIZERS = ("sgd", "adamw")
_TIMM_API = ("forward_features", "forward_head", "reset_classifier", "num_classes", "num_features")


def pool_block_output(x: torch.Tensor) -> torch.Tensor:
    """``B x C x H x W`` -> mean over space; ``B x N x D`` tokens -> mean over tokens; ``B x D`` as is."""
    if x.ndim == 4:
        return x.mean(dim=(2, 3))
    if x.ndim == 3:
        return x.mean(dim=1)
    return x


def first_conv_name(model: nn.Module) -> str | None:
    """Dotted name of the first ``Conv2d`` in registration order (the stem or patch embedding)."""
    return next((name for name, m in model.named_modules() if isinstance(m, nn.Conv2d)), None)


def set_input_channels_(model: nn.Module, in_chans: int) -> nn.Module:
    """Rebuild the first convolution of ``model`` for ``in_chans`` input channels when it differs.

    The new convolution keeps every other setting and gets timm ResNet's initialisation
    (Kaiming normal, fan-out, ReLU gain).
    """
    name = first_conv_name(model)
    if name is None:
        raise ValueError(f"network has no Conv2d to adapt to in_chans={in_chans}: {type(model).__name__}")
    conv = model.get_submodule(name)
    if conv.in_channels == in_chans:
        return model
    new = nn.Conv2d(in_chans, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                    conv.groups, bias=conv.bias is not None, padding_mode=conv.padding_mode,
                    device=conv.weight.device, dtype=conv.weight.dtype)
    nn.init.kaiming_normal_(new.weight, mode="fan_out", nonlinearity="relu")
    if new.bias is not None:
        nn.init.zeros_(new.bias)
    model.set_submodule(name, new)
    return model


class ImageClassifier(ClassificationSteps, LightningModule):
    """Cross-entropy classifier of a timm-style network with top-1/top-5 accuracy.

    Args:
        network: a timm-API network (``forward_features``, ``forward_head``,
            ``reset_classifier``), e.g. ``lightning_mods.backbone.resnet.ResNet50``.
        num_classes, in_chans: linked from the datamodule by the CLI; the network's head and
            first convolution are adapted to them.
        optimizer: ``sgd`` (``momentum``; Nesterov by default, as timm's ``sgd``) or ``adamw``
            (``betas``).
        base_lr: learning rate per 256 samples of GLOBAL batch (peak = base_lr * batch / 256).
        weight_decay: on weights only; norms, biases and shortcut alphas get none.
        warmup_epochs: linear per-step warm-up, then cosine to ``min_lr_ratio * peak``.
        label_smoothing: of the training loss (validation/test losses are plain).

    Extension points: :meth:`training_loss` (the loss) and :meth:`forward_head` (the head).
    """

    def __init__(
        self,
        network: nn.Module,
        num_classes: int = 1000,
        in_chans: int = 3,
        optimizer: Literal["sgd", "adamw"] = "sgd",
        base_lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 2e-5,
        warmup_epochs: float = 5.0,
        min_lr_ratio: float = 0.0,
        label_smoothing: float = 0.1,
    ) -> None:
        super().__init__()
        missing = [name for name in _TIMM_API if not hasattr(network, name)]
        if missing:
            raise ValueError(f"network must have timm's classifier API; {type(network).__name__} lacks "
                             f"{', '.join(missing)}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
        if num_classes < 1 or in_chans < 1:
            raise ValueError(f"num_classes and in_chans must be >= 1, got {num_classes} and {in_chans}")
        if optimizer == "sgd" and nesterov and momentum <= 0:
            raise ValueError(f"nesterov needs momentum > 0, got momentum={momentum}; set nesterov: false")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if base_lr <= 0 or weight_decay < 0 or warmup_epochs < 0:
            raise ValueError(f"base_lr must be > 0, weight_decay and warmup_epochs >= 0; got {base_lr}, "
                             f"{weight_decay}, {warmup_epochs}")
        self._save_hyperparameters_without_modules(network)

        if network.num_classes != num_classes:
            network.reset_classifier(num_classes)
        self.network = set_input_channels_(network, in_chans)
        self.num_features = int(network.num_features)
        self.init_accuracies(num_classes)

    def _save_hyperparameters_without_modules(self, network: nn.Module) -> None:
        # Under LightningCLI the saved hyperparameters are the parsed config, so ``network`` is
        # its class_path/init_args (plain data, ``load_from_checkpoint`` rebuilds it). Built in
        # Python, it is the module itself: keep only its class path, never a pickled module.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*'network' is an instance of `nn.Module`")
            self.save_hyperparameters()
        if isinstance(self.hparams.get("network"), nn.Module):
            class_path = f"{type(network).__module__}.{type(network).__qualname__}"
            self.hparams["network"] = class_path
            self._hparams_initial["network"] = class_path

    # --- forward ---------------------------------------------------------------------------
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits ``B x num_classes`` (timm's ``forward``: features, then the head)."""
        return self.forward_head(self.network.forward_features(images))

    def forward_head(self, feature_map: torch.Tensor) -> torch.Tensor:
        """Extension point: the head, logits ``B x num_classes`` from the network's
        ``forward_features`` output. Default: the network's own (timm's pooling and classifier
        layer, sized by ``reset_classifier(num_classes)``)."""
        return self.network.forward_head(feature_map)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """Evaluation features ``B x D``: the pooled input of the classifier layer."""
        return self.network.forward_head(self.network.forward_features(images), pre_logits=True)

    def forward_intermediates(self, images: torch.Tensor, indices: Indices = None, intermediates_only: bool = False):
        """``(forward_features, pooled output of the residual blocks indices picks)`` in depth
        order, ``B x C_k`` each, from one pass of the network (timm's call;
        :mod:`lightning_mods.evaluation.feature_contract`)."""
        outputs = self._block_outputs(images)
        blocks = [pool_block_output(outputs[i][0]) for i in take_indices(len(outputs) - 1, indices)]
        return blocks if intermediates_only else (self.network.forward_head(outputs[-1][1], pre_logits=True), blocks)

    def forward_patch_features(self, images: torch.Tensor, block: int = -1) -> torch.Tensor:
        """Spatial features of residual block ``block`` (Python index; -1 the last), ``B x H x W x C``:
        a ResNet block's feature map, or a ViT block's patch tokens on their grid (prefix tokens dropped)."""
        out = self._block_outputs(images)[:-1][block][0]
        if out.ndim == 4:
            return out.permute(0, 2, 3, 1)
        tokens = out[:, getattr(self.network, "num_prefix_tokens", 0):]
        grid = getattr(getattr(self.network, "patch_embed", None), "grid_size", None)
        height, width = grid if grid is not None else (int(tokens.shape[1] ** 0.5),) * 2
        return tokens.reshape(tokens.shape[0], height, width, tokens.shape[-1])

    def _block_outputs(self, images: torch.Tensor) -> list[tuple[torch.Tensor, object]]:
        """Every residual block's output in depth order, then ``(None, forward_features output)``."""
        outputs: list = []
        handles = [blk.register_forward_hook(lambda _m, _i, out: outputs.append((out, None)))
                   for blk in residual_blocks(self.network)]
        try:
            final = self.network.forward_features(images)
        finally:
            for handle in handles:
                handle.remove()
        return outputs + [(None, final)]

    # --- steps (training, validation, test: ClassificationSteps) ----------------------------
    def training_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Extension point: the loss training minimises, from logits ``B x num_classes`` and
        labels ``B``. Default: cross-entropy with ``label_smoothing``."""
        return F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)

    def predict_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        """``embeddings`` (``forward_features``), ``logits`` and ``labels``, for
        ``callbacks.reporting.prediction_writer``."""
        images, labels = batch[0], batch[1]
        features = self.network.forward_features(images)
        return {"embeddings": self.network.forward_head(features, pre_logits=True),
                "logits": self.network.forward_head(features), "labels": labels}

    # --- optimisation ----------------------------------------------------------------------
    def configure_optimizers(self):
        hp = self.hparams
        total = int(self.trainer.estimated_stepping_batches)  # also sets up the train loader
        peak = scaled_lr(hp.base_lr, global_batch_size(self.trainer))
        groups = param_groups_weight_decay(self, hp.weight_decay)
        if hp.optimizer == "sgd":
            optimizer = torch.optim.SGD(groups, lr=peak, momentum=hp.momentum, nesterov=hp.nesterov)
        else:
            optimizer = adamw(groups, lr=peak, betas=tuple(hp.betas))
        warmup = min(steps_from_epochs(self.trainer, hp.warmup_epochs), max(0, total - 1))
        return {"optimizer": optimizer,
                "lr_scheduler": warmup_cosine_scheduler(optimizer, warmup, total, hp.min_lr_ratio)}
