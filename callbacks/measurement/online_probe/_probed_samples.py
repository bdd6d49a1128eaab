"""One online probe's samples on their way to the heads: gathered from every rank, and held
until the check of their finiteness, copied to the host without waiting, has arrived
(:class:`ProbedQueue`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn

from callbacks._utils.distributed import all_gather_rows, all_reduce_sum


def gather_probed(features: torch.Tensor, labels: torch.Tensor,
                   blocks: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Every rank's probed samples (features, labels, block features) on every rank, rank
    order, in one all_gather (labels ride as float columns: exact below 2**24)."""
    parts = [features, *blocks.values(), labels.to(features.device, features.dtype).unsqueeze(1)]
    gathered = all_gather_rows(torch.cat(parts, dim=1))
    columns = gathered.split([p.shape[1] for p in parts], dim=1)
    return (columns[0], columns[-1].squeeze(1).round().to(labels.dtype).to(labels.device),
            dict(zip(blocks, columns[1:-1])))


@dataclass
class Probed:
    """One probe's samples waiting for the heads, and whether any feature was non-finite on any
    rank: ``nonfinite``, a host tensor that ``copied`` (a CUDA event, ``None`` elsewhere) says
    is filled."""

    features: torch.Tensor
    blocks: dict[int, torch.Tensor]
    labels: torch.Tensor
    nonfinite: torch.Tensor
    copied: Optional[Any] = None

    def state_dict(self) -> dict[str, Any]:
        if self.copied is not None:
            self.copied.synchronize()
        return {"features": self.features.detach().cpu().clone(), "labels": self.labels.detach().cpu().clone(),
                "blocks": {block: f.detach().cpu().clone() for block, f in self.blocks.items()},
                "nonfinite": self.nonfinite.clone()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Probed":
        return cls(state["features"], {int(b): f for b, f in state["blocks"].items()}, state["labels"],
                   state["nonfinite"])


def nonfinite_flag_to_host(*features: torch.Tensor) -> tuple[torch.Tensor, Optional[Any]]:
    """Whether any of ``features`` is non-finite on any rank (one all_reduce under DDP), copied to
    a host tensor without waiting (on CUDA: pinned memory and an event recorded after the copy)."""
    largest = torch.stack(torch._foreach_norm(list(features), float("inf")))  # NaN and inf propagate: one call
    flag = torch.logical_not(torch.isfinite(largest).all()).to(torch.int64).view(1)
    flag = all_reduce_sum(flag)
    if flag.device.type != "cuda":
        return flag.cpu(), None
    host = torch.empty(1, dtype=torch.int64, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


class ProbedQueue:
    """The probed samples on their way to the heads, and the epoch's per-head sums of what the
    heads scored on them.

    The heads step on a probe's samples at the next probe (or the epoch's end, a validation, the
    end of training), so that the finiteness flag, copied to the host asynchronously, is read
    without stalling the device; the heads see the same samples in the same order, and a
    checkpoint in between keeps the waiting samples."""

    KEYS = ("epoch_sums", "probed")  # its entries in the probe's state

    def __init__(self) -> None:
        self.probed: Optional[Probed] = None  # the last probe's samples, until their check reaches the host
        self.epoch_sums: Optional[torch.Tensor] = None  # this epoch's per-head (loss x n, correct, n) sums

    def put(self, heads: Callable[[], Any], features: torch.Tensor, labels: torch.Tensor, blocks: dict[int, torch.Tensor],
            gather: bool) -> None:
        """Queue one probe's samples (every rank's with ``gather``); the previous probe's, whose
        check reached the host long ago, go to ``heads``."""
        if gather:
            features, labels, blocks = gather_probed(features, labels, blocks)
        self.flush(heads)
        self.probed = Probed(features, blocks, labels, *nonfinite_flag_to_host(features, *blocks.values()))

    def flush(self, heads: Callable[[], Any]) -> None:
        """``heads()`` step on the waiting samples, unless a feature was non-finite on any rank."""
        if self.probed is None:
            return
        probed, self.probed = self.probed, None
        if probed.copied is not None:
            probed.copied.synchronize()  # the flag's copy only, queued with the features
        if probed.nonfinite.numpy().any():  # a host buffer: no device read
            rank_zero_warn("OnlineLinearProbe: non-finite features, the heads skip this step")
            return
        learner = heads()
        device = learner.device
        sums = learner.learn(probed.features.to(device), probed.labels.to(device),
                           {block: f.to(device) for block, f in probed.blocks.items()})
        added = all_reduce_sum(sums)  # every rank's fresh samples, summed on the device, logged per epoch
        self.epoch_sums = added if self.epoch_sums is None else self.epoch_sums.to(added.device) + added

    def epoch_means(self, heads: Callable[[], Any]) -> Optional[list[list[float]]]:
        """Per head ``[mean loss, top-1]`` of the epoch's fresh samples (after the waiting ones
        are learnt); ``None`` when the heads learnt nothing this epoch."""
        self.flush(heads)
        if self.epoch_sums is None:
            return None
        sums, self.epoch_sums = self.epoch_sums, None
        return (sums[:, :2] / sums[:, 2:]).tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_sums": None if self.epoch_sums is None else self.epoch_sums.detach().cpu().clone(),
                "probed": None if self.probed is None else self.probed.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch_sums = state.get("epoch_sums")
        saved = state.get("probed")
        self.probed = None if saved is None else Probed.from_state(saved)
