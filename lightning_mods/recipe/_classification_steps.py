"""The supervised steps a classifier and a linear probe share: cross-entropy training, top-1 and
top-5 accuracy on val and test, logged under the names of :mod:`lightning_mods.evaluation.metric_names`.

The accuracies are torchmetrics ``MulticlassAccuracy`` (micro) and the evaluation loss a
``MeanMetric`` of the per-sample losses: their counts are summed over ranks when the epoch value
is computed, and the samples a DDP ``DistributedSampler`` repeats are left out
(:mod:`lightning_mods.evaluation._distributed_eval`), so a DDP run reports the one-process
numbers of the whole split.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_mods.evaluation import metric_names
from lightning_mods.evaluation._distributed_eval import ExactEvaluation


def top_k_accuracy(num_classes: int, k: int) -> MulticlassAccuracy:
    """The fraction of samples whose label is among the ``k`` largest logits. ``average="micro"``
    is the point: torchmetrics' default (``"macro"``) is the mean of per-class recalls, another
    number on a split whose classes are not the same size."""
    return MulticlassAccuracy(num_classes, top_k=k, average="micro")


class ClassificationSteps(ExactEvaluation):
    """Mixin for a ``LightningModule`` whose ``forward`` returns logits ``B x num_classes`` and
    whose batches start ``(images, labels)``; call :meth:`init_accuracies` in ``__init__``."""

    def init_accuracies(self, num_classes: int) -> None:
        top5 = min(5, num_classes)
        self.train_top1 = top_k_accuracy(num_classes, 1)
        self.val_top1 = top_k_accuracy(num_classes, 1)
        self.val_top5 = top_k_accuracy(num_classes, top5)
        self.test_top1 = top_k_accuracy(num_classes, 1)
        self.test_top5 = top_k_accuracy(num_classes, top5)
        self.val_loss_mean, self.test_loss_mean = MeanMetric(), MeanMetric()

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

    def _evaluate(self, batch, batch_idx: int, stage: str, top1: MulticlassAccuracy, top5: MulticlassAccuracy) -> None:
        self.evaluate_logits(self(batch[0]), batch[1], stage, top1, top5, batch_idx)

    def evaluate_logits(self, logits: torch.Tensor, labels: torch.Tensor, stage: str, top1: MulticlassAccuracy,
                        top5: MulticlassAccuracy, batch_idx: int = 0) -> None:
        """Log the loss, top-1 and top-5 of ``logits`` for ``labels`` under ``stage`` (val, test),
        each image of the split counted once (``batch_idx``: the batch's place in the epoch)."""
        count, logits, labels = self.without_repeats(batch_idx, logits, labels)
        loss = self.val_loss_mean if stage == "val" else self.test_loss_mean
        if count:  # a batch of repeats only adds nothing (torchmetrics refuses empty updates)
            loss.update(F.cross_entropy(logits, labels, reduction="none"))
            top1.update(logits, labels)
            top5.update(logits, labels)
        self.log(metric_names.LOSS[stage], loss, batch_size=count)
        self.log(metric_names.TOP1[stage], top1, prog_bar=True, batch_size=count)
        self.log(metric_names.TOP5[stage], top5, batch_size=count)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "val", self.val_top1, self.val_top5)

    def test_step(self, batch, batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, "test", self.test_top1, self.test_top5)
