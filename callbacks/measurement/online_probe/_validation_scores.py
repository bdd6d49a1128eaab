"""One validation epoch's top-1 of every online probe head (and block head), and the blocks' mean
feature norms; torchmetrics counts, summed over ranks when read."""
from __future__ import annotations

from typing import Any

import torch

from lightning.pytorch.utilities import rank_zero_warn

from callbacks._utils.distributed import all_reduce_sum, log_identical
from callbacks._utils.feature_collection import loader_settings
from callbacks.measurement.shared_features import SharedEvaluation
from lightning_mods.evaluation._distributed_eval import padding_mask
from lightning_mods.evaluation import metric_names
from lightning_mods.recipe._classification_steps import top_k_accuracy
from ._heads import OnlineProbeHeads


class ValidationScores:
    """One validation epoch's top-1 of every head (and block head), and the blocks' mean feature
    norms; torchmetrics counts, summed over ranks when read."""

    def __init__(self, heads: OnlineProbeHeads) -> None:
        self.heads, self.device = heads, heads.device
        self.top1 = [self._accuracy() for _ in heads.lrs]
        self.block_top1: dict[int, list] = {}
        self.block_norm: dict[int, torch.Tensor] = {}
        self.total = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.seen = 0  # samples of validation dataloader 0 this rank saw this epoch, padding included
        self.nonfinite = False
        self._add_blocks(heads.block_heads)

    def _accuracy(self) -> Any:
        return top_k_accuracy(self.heads.num_classes, 1).to(self.device)

    def _add_blocks(self, blocks: Any) -> None:
        for block in blocks:
            if block not in self.block_top1:
                self.block_top1[block] = [self._accuracy() for _ in self.heads.lrs]
                self.block_norm[block] = torch.zeros((), dtype=torch.float64, device=self.device)

    def score_batch(self, trainer: Any, features: torch.Tensor, labels: torch.Tensor,
                    blocks: dict[int, torch.Tensor]) -> None:
        """Add one batch of the validation loop, less the duplicates a ``DistributedSampler`` pads with."""
        loaders = trainer.val_dataloaders
        real = padding_mask(loaders[0] if isinstance(loaders, (list, tuple)) else loaders, self.seen, len(labels))
        self.seen += len(labels)
        if real is not None:
            keep = real.to(features.device)
            features, labels, blocks = features[keep], labels[keep], {b: f[keep] for b, f in blocks.items()}
        self.score(features, labels, blocks)

    def score(self, features: torch.Tensor, labels: torch.Tensor, blocks: dict[int, torch.Tensor]) -> None:
        """Add one batch (this rank's samples, none twice) to the counts."""
        self._add_blocks(blocks)  # heads restored from a checkpoint are built at their first batch
        self.nonfinite = self.nonfinite or not bool(torch.isfinite(features).all())
        if not len(labels):  # a batch of padding only: torchmetrics refuses empty updates
            return
        with torch.no_grad():
            for head, accuracy in zip(self.heads.heads, self.top1):
                head.eval()
                accuracy.update(head(features), labels)
            for block, block_features in blocks.items():
                for head, accuracy in zip(self.heads.block_heads[block], self.block_top1[block]):
                    head.eval()
                    accuracy.update(head(block_features), labels)
                self.block_norm[block] += block_features.double().norm(dim=1).sum()
        self.total += len(labels)

    def log(self, pl_module: Any, names: list[str]) -> dict[int, dict[str, float]]:
        """Log every head's top-1 under ``names`` (NaN, with a warning, after a non-finite
        feature); the blocks' rows. Every rank calls it."""
        nonfinite, total, values, blocks = self.results(names)
        if nonfinite:
            rank_zero_warn("OnlineLinearProbe: non-finite validation features; logging NaN")
            log_identical(pl_module, {name: float("nan") for name in names})
        elif total:
            log_identical(pl_module, values)
        return blocks

    def results(self, names: list[str]) -> tuple[bool, int, dict[str, float], dict[int, dict[str, float]]]:
        """``(any non-finite feature, samples counted, {name: top-1}, {block: {name: top-1,
        feature/norm}})`` over every rank (collectives: every rank calls it); NaN where a feature
        was non-finite."""
        nonfinite = bool(int(all_reduce_sum(torch.tensor([int(self.nonfinite)], device=self.device))))
        total = int(all_reduce_sum(self.total))
        if not total:
            return nonfinite, 0, {}, {}

        def read(accuracies: list) -> dict[str, float]:  # compute() sums the counts over ranks
            return {name: float("nan") if nonfinite else accuracy.compute().item()
                    for name, accuracy in zip(names, accuracies)}

        blocks = {block: {**read(self.block_top1[block]),
                          metric_names.FEATURE_NORM: float(all_reduce_sum(self.block_norm[block].view(1))) / total}
                  for block in sorted(self.heads.block_heads)}
        return nonfinite, total, read(self.top1), blocks


def shared_validation(trainer: Any) -> bool:
    """Whether validation reads the shared pass over the datamodule's ``val_dataset``
    (:mod:`callbacks.measurement.shared_features`) rather than the validation loop's batches."""
    return getattr(getattr(trainer, "datamodule", None), "val_dataset", None) is not None


def shared_features(trainer: Any, pl_module: Any, with_blocks: bool) -> Any:
    """This rank's strided part of the shared pass over ``val_dataset`` (with the blocks' outputs)."""
    batch_size, num_workers = loader_settings(trainer, None, None)
    return SharedEvaluation.of(trainer).features(trainer, pl_module, "val_dataset", "OnlineLinearProbe", batch_size,
                                                 num_workers, with_blocks=with_blocks, gather=False)
