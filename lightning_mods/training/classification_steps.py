"""The supervised steps a classifier and a linear probe share: cross-entropy training, top-1 and
top-5 accuracy on val and test, logged under the names of :mod:`lightning_mods.evaluation.metric_names`.

The accuracies are torchmetrics ``MulticlassAccuracy`` (micro): Lightning syncs them across
ranks when it computes the epoch value, so a DDP run reports the accuracy of the whole split.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from lightning_mods.evaluation import metric_names


def top_k_accuracy(num_classes: int, k: int) -> MulticlassAccuracy:
    """The fraction of samples whose label is among the ``k`` largest logits. ``average="micro"``
    is the point: torchmetrics' default (``"macro"``) is the mean of per-class recalls, another
    number on a split whose classes are not the same size."""
    return MulticlassAccuracy(num_classes, top_k=k, average="micro")


class ClassificationSteps:
    """Mixin for a ``LightningModule`` whose ``forward`` returns logits ``B x num_classes`` and
    whose batches start ``(images, labels)``; call :meth:`init_accuracies` in ``__init__``."""

    def init_accuracies(self, num_classes: int) -> None:
        top5 = min(5, num_classes)
        self.train_top1 = top_k_accuracy(num_classes, 1)
        self.val_top1 = top_k_accuracy(num_classes, 1)
        self.val_top5 = top_k_accuracy(num_classes, top5)
        self.test_top1 = top_k_accuracy(num_classes, 1)
        self.test_top5 = top_k_accuracy(num_classes, top5)

    def training_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss the training step minimises (plain cross-entropy here)."""
        return F.cross_entropy(logits, labels)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self.train_on_logits(self(batch[0]), batch[1])

    def train_on_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss of ``logits`` for ``labels``, logged with the training top-1."""
        loss = self.training_loss(logits, labels)
        self.train_top1.update(logits, labels)  # logged per epoch: no batch value to compute (Metric.forward)
        # no prog_bar: Lightning reads prog_bar values to the host after every step (a GPU sync);
        # callbacks/reporting/progress_bar.py shows the loss at the logging cadence
        self.log(metric_names.TRAIN_LOSS, loss, on_step=True, on_epoch=True, batch_size=labels.shape[0])
        self.log(metric_names.TRAIN_TOP1, self.train_top1, on_step=False, on_epoch=True, batch_size=labels.shape[0])
        return loss

    def _evaluate(self, batch, stage: str, top1: MulticlassAccuracy, top5: MulticlassAccuracy) -> None:
        self.evaluate_logits(self(batch[0]), batch[1], stage, top1, top5)

    def evaluate_logits(self, logits: torch.Tensor, labels: torch.Tensor, stage: str, top1: MulticlassAccuracy,
                        top5: MulticlassAccuracy) -> None:
        """Log the loss, top-1 and top-5 of ``logits`` for ``labels`` under ``stage`` (val, test)."""
        self.log(metric_names.LOSS[stage], F.cross_entropy(logits, labels), sync_dist=True, batch_size=labels.shape[0])
        top1(logits, labels)
        top5(logits, labels)
        self.log(metric_names.TOP1[stage], top1, prog_bar=True, batch_size=labels.shape[0])
        self.log(metric_names.TOP5[stage], top5, batch_size=labels.shape[0])

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_top1, self.val_top5)

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_top1, self.test_top5)
