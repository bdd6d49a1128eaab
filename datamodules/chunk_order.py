"""A training order that reads a conversion chunk by chunk (litdata's chunk-interval shuffle, for
the package's map-style loaders), so that from object storage every chunk is fetched once an
epoch, and a chunk's samples are read while it is in the cache.

Each epoch the chunks are put in an order drawn from ``seed + epoch`` and each chunk's samples
in an order drawn from the same generator; the sequence is split into ``num_replicas`` runs of
consecutive chunks, one per process (the last ones padded from the start, as
``DistributedSampler`` pads), so a chunk is read by one process, two at a run's edge. The samples
of a batch come from one or two chunks; ``shortcutlab chunks`` spreads every class over every
chunk (:func:`datamodules.streamed_images.spread_stride`), so a batch still mixes the classes.

Being a ``DistributedSampler`` it is the order Lightning keeps under DDP (it replaces a plain
shuffling sampler by its own), and :class:`datamodules.resumable.ResumableLoader` resumes it
mid-epoch as any epoch-seeded sampler.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

import torch
from torch.utils.data import DistributedSampler

from datamodules.resumable import default_shuffle_seed


class ChunkOrder(DistributedSampler):
    """Every sample of the chunks ``chunk_sizes`` once an epoch across the processes, chunk by chunk.

    Args:
        chunk_sizes: the samples of each chunk, in stored order (positions ``0..n-1`` run through them).
        index_of: the dataset index of the sample stored at a position.
        num_replicas, rank: the processes sharing the epoch and this one's rank.
        seed: the order's seed (default: ``seed_everything``'s, as Lightning's sampler).
    """

    def __init__(self, chunk_sizes: Sequence[int], index_of: Callable[[int], int], num_replicas: int = 1,
                 rank: int = 0, seed: int | None = None) -> None:
        if not chunk_sizes or min(chunk_sizes) < 1:
            raise ValueError(f"ChunkOrder: every chunk needs a sample, got chunk sizes {list(chunk_sizes)[:8]}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"ChunkOrder: rank must be in [0, {num_replicas}), got {rank}")
        self.chunk_sizes, self.index_of = [int(n) for n in chunk_sizes], index_of
        self.num_samples_total = sum(self.chunk_sizes)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.seed = default_shuffle_seed() if seed is None else int(seed)
        self.epoch = 0
        self.num_samples = math.ceil(self.num_samples_total / self.num_replicas)  # this rank's, padded
        self.total_size = self.num_samples * self.num_replicas
        self.shuffle, self.drop_last = True, False
        self.starts = [0]
        for size in self.chunk_sizes[:-1]:
            self.starts.append(self.starts[-1] + size)

    def positions(self) -> list[int]:
        """This epoch's stored positions for every process, in reading order (padded)."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = []
        for chunk in torch.randperm(len(self.chunk_sizes), generator=generator).tolist():
            inside = torch.randperm(self.chunk_sizes[chunk], generator=generator) + self.starts[chunk]
            order += inside.tolist()
        padding = self.total_size - len(order)
        return order + (order * math.ceil(padding / len(order)))[:padding]

    def __iter__(self) -> Iterator[int]:
        mine = self.positions()[self.rank * self.num_samples:(self.rank + 1) * self.num_samples]
        return iter([self.index_of(position) for position in mine])

    def __len__(self) -> int:
        return self.num_samples
