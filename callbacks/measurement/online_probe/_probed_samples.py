"""One online probe's samples on their way to the heads: gathered from every rank, and held
until the check of their finiteness, copied to the host without waiting, has arrived."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

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
