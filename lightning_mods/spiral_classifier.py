"""The spiral classifier of the ResidualDroppath paper's feature-reuse study (the ResidualDroppath paper, section 3;
"ResidualDroppath", section 3.1): :class:`~lightning_mods.backbone.residual_mlp.ResidualMLP`
trained with cross-entropy and Adam."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_mods.evaluation import metric_names
from lightning_mods.recipe._classification_steps import top_k_accuracy
from lightning_mods.backbone.residual_mlp import ResidualMLP
from lightning_mods.checkpointing.network_settings import network_settings
from lightning_mods.evaluation._distributed_eval import ExactEvaluation
from lightning_mods.evaluation.feature_contract import Indices, take_indices


class SpiralClassifier(ExactEvaluation, LightningModule):
    """Trains a :class:`ResidualMLP` on the spiral: cross-entropy, Adam (the ResidualDroppath paper: lr 0.1, batch 256).

    Args:
        network: the residual MLP (paper: depth 6 width 6, depth 32 width 32; default: depth 6
            width 6, standard shortcuts); a head of another size is replaced for ``num_classes``.
        num_classes: linked from the datamodule by the CLI (2 for the spiral).
        lr, betas: Adam (the paper: 0.1 and (0.9, 0.999)), constant learning rate.
    """

    def __init__(self, network: Optional[ResidualMLP] = None, num_classes: int = 2, lr: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.999)) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        network = ResidualMLP(num_classes=num_classes) if network is None else network
        if not isinstance(network, ResidualMLP):
            raise ValueError(f"SpiralClassifier: network must be a ResidualMLP (or a subclass); "
                             f"got {type(network).__name__}")
        if network.num_classes != num_classes:
            network.reset_classifier(num_classes)
        self.network = network
        self.save_hyperparameters(ignore=["network"])
        # the resolved settings of the network (plain data), so a checkpoint rebuilds this very network
        self.hparams["network"] = self._hparams_initial["network"] = network_settings(network)
        self.num_features = network.width
        self.train_acc = top_k_accuracy(num_classes, 1)
        self.val_acc = top_k_accuracy(num_classes, 1)
        self.test_acc = top_k_accuracy(num_classes, 1)
        self.val_loss_mean, self.test_loss_mean = MeanMetric(), MeanMetric()

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.network(points)

    def forward_features(self, points: torch.Tensor) -> torch.Tensor:
        """Output of the last residual layer, ``B x width``."""
        return self.network.forward_features(points)

    def forward_intermediates(self, points: torch.Tensor, indices: Indices = None, intermediates_only: bool = False):
        """``(forward_features, output of the residual layers indices picks)``, ``B x width`` each
        (already pooled: no spatial axes), from one pass (timm's call;
        :mod:`lightning_mods.evaluation.feature_contract`)."""
        layers = self.network.forward_layers(points)[1:]
        blocks = [layers[i] for i in take_indices(len(layers), indices)]
        return blocks if intermediates_only else (layers[-1], blocks)

    def _step(self, batch, stage: str, accuracy: MulticlassAccuracy, batch_idx: int = 0) -> torch.Tensor:
        points, labels = batch[0], batch[1]
        logits = self(points)
        training = stage == "train"
        if training:
            loss = F.cross_entropy(logits, labels)
            accuracy.update(logits, labels)  # logged per epoch: no batch value to compute (Metric.forward)
            # the classifier's way: the loss per step and as epoch mean, accuracies per epoch; no prog_bar for
            # the training loss (callbacks/reporting/progress_bar.py shows it without a host read per step)
            self.log(metric_names.LOSS[stage], loss, on_step=True, on_epoch=True, batch_size=labels.shape[0])
            count = labels.shape[0]
        else:  # each point of the split once, also under DDP (lightning_mods.evaluation._distributed_eval)
            count, logits, labels = self.without_repeats(batch_idx, logits, labels)
            mean = self.val_loss_mean if stage == "val" else self.test_loss_mean
            loss = F.cross_entropy(logits, labels, reduction="none")
            if count:
                mean.update(loss)
                accuracy.update(logits, labels)
            self.log(metric_names.LOSS[stage], mean, on_step=False, on_epoch=True, batch_size=count)
        self.log(metric_names.TOP1[stage], accuracy, prog_bar=not training, on_step=False, on_epoch=True,
                 batch_size=count)
        return loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train", self.train_acc)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "val", self.val_acc, batch_idx)

    def test_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "test", self.test_acc, batch_idx)

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self(batch[0] if isinstance(batch, (tuple, list)) else batch).softmax(dim=-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr, betas=tuple(self.hparams.betas))
