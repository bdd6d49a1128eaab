"""Collectives the evaluation callbacks share (the decay paper, section 6).

Every function works without a process group (one process: no-ops) and under
``torch.distributed`` with gloo (CPU tensors) or NCCL (CUDA tensors). Tensors are moved to
the backend's device for the collective and back to where they were afterwards.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule



def is_distributed() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world_size() -> tuple[int, int]:
    """``(global rank, world size)``; ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _backend_device(tensor: torch.Tensor) -> torch.device:
    """Where the default group's backend wants ``tensor``: gloo reduces CPU tensors, NCCL CUDA
    tensors (a mixed ``cpu:gloo,cuda:nccl`` group takes either)."""
    backend = str(dist.get_backend())
    if backend == "gloo" or ("gloo" in backend and tensor.device.type == "cpu"):
        return torch.device("cpu")
    if "nccl" in backend and tensor.device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


def _all_reduce(tensor: torch.Tensor, op: "dist.ReduceOp") -> torch.Tensor:
    if not is_distributed():
        return tensor.clone()
    work = tensor.detach().to(_backend_device(tensor), copy=True)
    dist.all_reduce(work, op=op)
    return work.to(tensor.device)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over all ranks (a new tensor on ``tensor``'s device)."""
    return _all_reduce(tensor, dist.ReduceOp.SUM)


def all_reduce_min(tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise minimum of ``tensor`` over all ranks (a new tensor on ``tensor``'s device)."""
    return _all_reduce(tensor, dist.ReduceOp.MIN)


def average_across_ranks_(tensors: Iterable[torch.Tensor]) -> None:
    """Replace every tensor by its mean over ranks, in place, with one flat all-reduce."""
    if not is_distributed():  # first: the probes call it every head step, on one process too
        return
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    flat = all_reduce_sum(flat) / dist.get_world_size()
    offset = 0
    for t in tensors:
        n = t.numel()
        t.data.copy_(flat[offset:offset + n].view_as(t).to(t.dtype))
        offset += n


def broadcast_from_rank_zero(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``tensor`` on every rank (same shape and dtype on all ranks required)."""
    if not is_distributed():
        return tensor
    work = tensor.detach().to(_backend_device(tensor), copy=True)
    dist.broadcast(work, src=0)
    return work.to(tensor.device)


def all_gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of ``local`` (the same shape on every rank), concatenated in rank order,
    on every rank."""
    if not is_distributed():
        return local
    work = local.detach().to(_backend_device(local))
    parts = [torch.empty_like(work) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, work.contiguous())
    return torch.cat(parts).to(local.device)


def strided_shard(total: int, rank: int, world_size: int) -> range:
    """The indices ``rank, rank + world_size, ...`` below ``total``: no padding, no duplicates."""
    return range(rank, total, world_size)


def gather_strided(local: torch.Tensor, total: int, strategy: Any = None) -> torch.Tensor:
    """Undo :func:`strided_shard`: every rank's rows, back in dataset order, on every rank.

    ``local`` holds this rank's rows (``len(strided_shard(total, rank, W))`` of them). Ranks
    pad to the largest shard, ``ceil(total / W)``, all-gather, then drop the padding, so the
    result has exactly ``total`` rows and is identical on every rank. With a Lightning
    ``strategy`` the gather is its ``all_gather`` (as Lightning's own callbacks gather).
    """
    if strategy is None:
        rank, world_size = rank_and_world_size()
    else:  # one process: a single-device strategy (or a stand-in) need not know ranks
        world_size = int(getattr(strategy, "world_size", 1) or 1)
        rank = int(strategy.global_rank) if world_size > 1 else 0
    if len(local) != len(strided_shard(total, rank, world_size)):
        raise ValueError(f"gather_strided: rank {rank} holds {len(local)} rows, its shard of {total} has "
                         f"{len(strided_shard(total, rank, world_size))}")
    if world_size == 1:
        return local
    largest = math.ceil(total / world_size)
    padded = local.new_zeros((largest, *local.shape[1:]))
    padded[:len(local)] = local
    out = local.new_empty((total, *local.shape[1:]))
    if strategy is None:
        parts = all_gather_rows(padded).split(largest)
    else:  # world_size x largest x ...
        parts = strategy.all_gather(padded.to(strategy.root_device)).to(local.device)
    for r, part in enumerate(parts):
        out[r::world_size] = part[:len(strided_shard(total, r, world_size))]
    return out


def log_identical(pl_module: LightningModule, metrics: dict[str, float], **log_kwargs) -> None:
    """Log epoch-level values that are already the same on every rank.

    ``sync_dist`` with ``max`` leaves identical values unchanged, makes them identical if they
    were not, and keeps them usable by ModelCheckpoint / EarlyStopping on every rank.
    """
    for name, value in metrics.items():
        pl_module.log(name, float(value), on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max",
                      **log_kwargs)
