"""Replay of recent features (a piece of the online probe).

A probe that embeds a few images every few steps gets few fresh samples, and one head step on
each handful leaves the head short of steps: after the quickstart's 100 epochs such a probe
(32 images every 4th batch) was 7 points below the probe that embeds every full batch. Keeping
the last ``samples`` probed samples' features and sweeping them once per probe (one head step
per training batch, as the every-batch probe takes) gives the head the every-batch probe's
number of steps and batch size while the network embeds a fraction of the images (the
probe's defaults: 16 of 128 every 4th batch, 1/32, and ``replay: {samples: 512}``). The features replayed are at most
``samples / samples per probe`` probes old.

The buffer lives on the heads' device and never reads back to the host: adding and choosing
rows are index kernels, the row counts are known on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

OWNER = "OnlineLinearProbe"
Batches = list[tuple[torch.Tensor, torch.Tensor]]


class FeatureReplay:
    """The newest ``capacity`` rows of (features ``N x D``, labels ``N``), a ring buffer.

    :meth:`rows` names them by age, 0 the newest, so that the head's first replayed batch
    starts with the samples just added.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 2:
            raise ValueError(f"FeatureReplay: capacity must be an integer >= 2, got {capacity!r}")
        self.capacity = capacity
        self.features: Optional[torch.Tensor] = None
        self.labels: Optional[torch.Tensor] = None
        self.end = 0  # the row after the newest
        self.filled = 0  # rows holding a sample

    def add(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Append a batch (its last ``capacity`` rows when it is larger), dropping the oldest rows."""
        features, labels = features.detach()[-self.capacity:], labels[-self.capacity:]
        if self.features is None:
            self.features = features.new_zeros((self.capacity, features.shape[1]))
            self.labels = labels.new_zeros((self.capacity,))
        elif features.shape[1] != self.features.shape[1]:
            raise ValueError(f"FeatureReplay: features of width {features.shape[1]}, the buffer holds "
                             f"{self.features.shape[1]}")
        n = len(labels)
        rows = (self.end + torch.arange(n, device=self.features.device)) % self.capacity
        self.features.index_copy_(0, rows, features.to(self.features.dtype))
        self.labels.index_copy_(0, rows, labels.to(self.labels.device))
        self.end = (self.end + n) % self.capacity
        self.filled = min(self.filled + n, self.capacity)

    def rows(self, first_age: int, count: int, wrap: bool = False) -> torch.Tensor:
        """Row indices of the samples of ages ``first_age, first_age + 1, ...`` (0: the newest),
        ``min(count, filled)`` of them (``wrap``: ``count`` of them, going round again), ages taken
        modulo the rows filled."""
        if self.filled == 0:
            raise ValueError("FeatureReplay: nothing added yet")
        n = count if wrap else min(count, self.filled)
        ages = (first_age + torch.arange(n, device=self.features.device)) % self.filled
        return (self.end - 1 - ages) % self.capacity

    def state_dict(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "end": self.end, "filled": self.filled,
                "features": None if self.features is None else self.features.detach().cpu().clone(),
                "labels": None if self.labels is None else self.labels.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        if int(state["capacity"]) != self.capacity:
            raise ValueError(f"FeatureReplay: the checkpoint replays {state['capacity']} samples, this probe "
                             f"{self.capacity}")
        self.end, self.filled = int(state["end"]), int(state["filled"])
        self.features = None if state["features"] is None else state["features"].to(device)
        self.labels = None if state["labels"] is None else state["labels"].to(device)

    def to(self, device: torch.device) -> "FeatureReplay":
        if self.features is not None:
            self.features, self.labels = self.features.to(device), self.labels.to(device)
        return self


def is_whole_number(value: Any, least: int) -> bool:
    """An ``int`` (not a bool) of at least ``least``."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= least


@dataclass(frozen=True)
class Replay:
    """Replay the last ``samples`` probed samples: per probe, ``head_steps`` head steps of
    ``head_batch`` rows each, newest first, going round the replay again where the steps ask for
    more rows than it holds.

    Args:
        samples: the replay's rows (at least 2 per head step: ``samples // every_n_steps >= 2``).
        head_batch: rows a head step (default ``samples // every_n_steps``: one sweep a probe).
        head_steps: head steps a probe (default ``every_n_steps``: one per training batch).
    """

    samples: int = 512
    head_batch: Optional[int] = None
    head_steps: Optional[int] = None

    def __post_init__(self) -> None:
        if not is_whole_number(self.samples, 2):
            raise ValueError(f"{OWNER}: replay.samples must be an integer >= 2, got {self.samples!r}")
        if self.head_batch is not None and not (is_whole_number(self.head_batch, 2) and self.head_batch <= self.samples):
            raise ValueError(f"{OWNER}: replay.head_batch must be None or an integer from 2 to replay.samples "
                             f"({self.samples}), got {self.head_batch!r}")
        if self.head_steps is not None and not is_whole_number(self.head_steps, 1):
            raise ValueError(f"{OWNER}: replay.head_steps must be None or an integer >= 1, got {self.head_steps!r}")

    def sweep(self, every_n_steps: int) -> "ReplaySweep":
        """How a probe of cadence ``every_n_steps`` steps its heads through this replay."""
        if self.samples // every_n_steps < 2:
            raise ValueError(f"{OWNER}: replay.samples must give at least 2 samples per head step "
                             f"(samples // every_n_steps >= 2), got {self.samples} with every_n_steps {every_n_steps}")
        return ReplaySweep(self.samples, self.head_batch or self.samples // every_n_steps,
                           self.head_steps or every_n_steps)


@dataclass(frozen=True)
class ReplaySweep:
    """A :class:`Replay` at a probe's cadence: ``head_steps`` batches of ``head_batch`` rows a probe."""

    samples: int
    head_batch: int
    head_steps: int

    def new_replay(self) -> FeatureReplay:
        return FeatureReplay(self.samples)

    def batches(self, replay: FeatureReplay, features: torch.Tensor, labels: torch.Tensor) -> Batches:
        """Add the fresh samples to ``replay``; the head steps' batches, chosen with one index per probe."""
        replay.add(features, labels)
        size = self.head_batch
        if replay.filled < size:  # the first probes: every step sweeps all there is
            return [(replay.features.index_select(0, rows), replay.labels.index_select(0, rows))
                    for rows in (replay.rows(i * size, size) for i in range(self.head_steps))]
        rows = replay.rows(0, size * self.head_steps, wrap=True)
        chosen, chosen_labels = replay.features.index_select(0, rows), replay.labels.index_select(0, rows)
        return list(zip(chosen.split(size), chosen_labels.split(size)))
