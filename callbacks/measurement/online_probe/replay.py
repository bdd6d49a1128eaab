"""Replay of recent features (a piece of the online probe).

A probe that embeds a few images every few steps gets few fresh samples, and one head step on
each handful leaves the head short of steps: after the quickstart's 100 epochs such a probe
(32 images every 4th batch) was 7 points below the probe that embeds every full batch. Keeping
the last ``samples`` probed samples' features and sweeping them once per probe (one head step
per training batch, as the every-batch probe takes) gives the head the every-batch probe's
number of steps and batch size while the network embeds a fraction of the images (the
probe's defaults: 16 of 128 every 4th batch, 1/32). The features replayed are at most
``samples / samples per probe`` probes old.

The buffer lives on the heads' device and never reads back to the host: adding and choosing
rows are index kernels, the row counts are known on the host.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

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


class ReplaySweep:
    """How a probe's fresh samples become its head steps: added to a :class:`FeatureReplay` of
    ``samples`` rows, then ``head_steps`` steps of ``head_batch`` rows each, newest first, going
    round the replay again where the steps ask for more rows than it holds.

    Args:
        samples: the replay's rows.
        every_n_steps: the probe's cadence; ``head_batch`` defaults to ``samples // every_n_steps``
            (one sweep of the replay per probe) and ``head_steps`` to ``every_n_steps`` (one head
            step per training batch).
    """

    def __init__(self, samples: int, every_n_steps: int, head_batch: Optional[int] = None,
                 head_steps: Optional[int] = None, owner: str = "OnlineLinearProbe") -> None:
        if not (is_whole_number(samples, 2) and samples // every_n_steps >= 2):
            raise ValueError(f"{owner}: replay_samples must be None or an integer with at least 2 samples per head "
                             f"step (replay_samples // every_n_steps >= 2), got {samples!r}")
        if head_batch is not None and not (is_whole_number(head_batch, 2) and head_batch <= samples):
            raise ValueError(f"{owner}: head_batch must be None or an integer from 2 to replay_samples "
                             f"({samples}), got {head_batch!r}")
        if head_steps is not None and not is_whole_number(head_steps, 1):
            raise ValueError(f"{owner}: head_steps must be None or an integer >= 1 with a replay "
                             f"(replay_samples {samples}), got {head_steps!r}")
        self.samples = samples
        self.head_batch = head_batch or samples // every_n_steps
        self.head_steps = head_steps or every_n_steps

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


def replay_sweep(samples: Optional[int], every_n_steps: int, head_batch: Optional[int] = None,
                 head_steps: Optional[int] = None, owner: str = "OnlineLinearProbe") -> Optional[ReplaySweep]:
    """The sweep of a probe's settings; ``None`` without a replay (``samples`` None), where
    ``head_batch`` and ``head_steps`` have nothing to sweep and are a one-line error."""
    if samples is not None:
        return ReplaySweep(samples, every_n_steps, head_batch, head_steps, owner)
    if head_batch is not None:
        raise ValueError(f"{owner}: head_batch must be None without a replay (replay_samples None), got {head_batch!r}")
    if head_steps is not None:
        raise ValueError(f"{owner}: head_steps must be None without a replay (replay_samples None), got {head_steps!r}")
    return None
