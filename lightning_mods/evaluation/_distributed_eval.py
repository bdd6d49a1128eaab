"""Validation and test metrics over exactly the dataset under DDP.

Lightning gives each rank of a DDP evaluation a ``DistributedSampler`` that repeats the first
samples of the list until every rank has as many (``drop_last`` off), so the ranks' counts
together hold some images twice whenever the set's size is not a multiple of the world size.
:meth:`ExactEvaluation.real_samples` says which samples of a batch are the repeated ones, so
the modules leave them out of every accuracy and loss, and sum counts (torchmetrics states)
over ranks: a DDP evaluation reports the one-process number. Where a validation loss draws random
numbers (the MAE's masks, the diffusion model's noise and times), :meth:`ExactEvaluation.sample_indices`
gives each sample its dataset index, so that its draws come from a generator seeded by it: every
image gets the same draws whichever rank and batch it lands in.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler


def padding_mask(dataloader: object, start: int, batch_size: int) -> Optional[torch.Tensor]:
    """Which samples of a batch are real, not the duplicates a DistributedSampler pads with.

    ``start`` is the position of the batch's first sample in this rank's stream of the epoch.
    A ``DistributedSampler`` (drop_last off) appends the first indices of its list again to
    make every rank's share equal, then gives rank ``r`` positions ``r, r + W, ...``; sample
    ``j`` of rank ``r`` is a duplicate when ``r + j * W >= len(dataset)``, shuffled or not.
    Returns ``None`` when the loader has no such sampler (every sample is real).
    """
    sampler = getattr(dataloader, "sampler", None) if isinstance(dataloader, DataLoader) else None
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return None
    positions = torch.arange(start, start + batch_size)
    return sampler.rank + positions * sampler.num_replicas < len(sampler.dataset)


class ExactEvaluation:
    """Mixin of a LightningModule whose evaluation steps count each image once under DDP."""

    def _batch_start(self, batch_size: int, batch_idx: int, dataloader_idx: int) -> tuple[object, int]:
        """The evaluation loader and the position of this batch's first sample in this rank's
        stream; asking again for the same batch gives the same position."""
        trainer = getattr(self, "_trainer", None)
        loaders = trainer.test_dataloaders if trainer.testing else trainer.val_dataloaders
        loader = loaders[dataloader_idx] if isinstance(loaders, (list, tuple)) else loaders
        seen = self.__dict__.setdefault("_evaluation_seen", {})  # loader -> its last batch: (index, start, size)
        last_batch, last_start, last_size = seen.get(dataloader_idx, (None, 0, 0))
        if batch_idx == last_batch:  # asked again for the same batch
            start = last_start
        else:  # a new loop starts at batch 0; the next batch where the last one ended
            start = 0 if batch_idx == 0 else last_start + last_size
        seen[dataloader_idx] = (batch_idx, start, batch_size)
        return loader, start

    def real_samples(self, batch_size: int, batch_idx: int, dataloader_idx: int = 0) -> Optional[torch.Tensor]:
        """The mask of this evaluation batch's real samples on this rank (``None``: all real),
        from ``validation_step`` or ``test_step``; asking again for the same batch gives the same
        mask."""
        if getattr(self, "_trainer", None) is None:  # called outside a Trainer: nothing is repeated
            return None
        loader, start = self._batch_start(batch_size, batch_idx, dataloader_idx)
        return padding_mask(loader, start, batch_size)

    def sample_indices(self, batch_size: int, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """The dataset index of each sample of this evaluation batch (a CPU int64 tensor): under a
        ``DistributedSampler`` the index it hands this rank, else the sample's position in the
        epoch (the index, for an unshuffled loader). Outside a Trainer: ``0 .. batch_size - 1``."""
        if getattr(self, "_trainer", None) is None:
            return torch.arange(batch_size)
        loader, start = self._batch_start(batch_size, batch_idx, dataloader_idx)
        positions = torch.arange(start, start + batch_size)
        sampler = getattr(loader, "sampler", None) if isinstance(loader, DataLoader) else None
        if not isinstance(sampler, DistributedSampler):
            return positions
        key = (id(sampler), sampler.epoch)  # this rank's indices, padding included: once per epoch
        cached = self.__dict__.get("_sampler_order")
        if cached is None or cached[0] != key:
            cached = (key, torch.as_tensor(list(iter(sampler)), dtype=torch.int64))
            self.__dict__["_sampler_order"] = cached
        order = cached[1]
        return order[positions.clamp(max=len(order) - 1)]

    def without_repeats(self, batch_idx: int, *tensors: torch.Tensor, dataloader_idx: int = 0) -> tuple:
        """``tensors`` (batch-first, one batch) without the samples a DistributedSampler repeated;
        the count of real samples first."""
        size = len(tensors[0])
        real = self.real_samples(size, batch_idx, dataloader_idx)
        if real is None:
            return (size, *tensors)
        return (int(real.sum()), *(t[real.to(t.device)] for t in tensors))
