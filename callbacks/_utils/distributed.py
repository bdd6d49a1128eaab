"""Collectives the evaluation callbacks share (the decay paper, section 6).

Every function works without a process group (one process: no-ops) and under
``torch.distributed`` with gloo (CPU tensors) or NCCL (CUDA tensors). Tensors are moved to
the backend's device for the collective and back to where they were afterwards.
"""
from __future__ import annotations

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


def _block_starts(total: int, rank: int, world_size: int, block: int) -> range:
    """Where this rank's blocks start: ``rank x block``, then every ``W x block``, below ``total``."""
    if block < 1:
        raise ValueError(f"block_shard: block must be >= 1, got {block}")
    return range(rank * block, total, world_size * block)


def block_shard(total: int, rank: int, world_size: int, block: int) -> list[int]:
    """The indices this rank embeds: the blocks ``rank, rank + W, ...`` of ``block`` consecutive
    indices below ``total`` (the last block may be shorter). No padding, no duplicates, and every
    block is the same batch of samples whatever the world size, so it is embedded by the same
    arithmetic at 1 or 64 processes."""
    return [i for start in _block_starts(total, rank, world_size, block) for i in range(start, min(start + block, total))]


def block_shard_sizes(total: int, world_size: int, block: int) -> list[int]:
    """How many indices each rank's :func:`block_shard` holds, in rank order."""
    return [sum(min(block, total - start) for start in _block_starts(total, rank, world_size, block))
            for rank in range(world_size)]


def gather_blocks(local: torch.Tensor, total: int, block: int, strategy: Any = None) -> torch.Tensor:
    """Undo :func:`block_shard`: every rank's rows, back in dataset order, on every rank.

    ``local`` holds this rank's rows. Ranks pad to the largest shard, all-gather, then put each
    block where it belongs, so the result has exactly ``total`` rows and is identical on every rank.
    With a Lightning ``strategy`` the gather is its ``all_gather`` (as Lightning's own callbacks gather).
    """
    if strategy is None:
        rank, world_size = rank_and_world_size()
    else:  # one process: a single-device strategy (or a stand-in) need not know ranks
        world_size = int(getattr(strategy, "world_size", 1) or 1)
        rank = int(strategy.global_rank) if world_size > 1 else 0
    sizes = block_shard_sizes(total, world_size, block)
    if len(local) != sizes[rank]:
        raise ValueError(f"gather_blocks: rank {rank} holds {len(local)} rows, its shard of {total} has {sizes[rank]}")
    if world_size == 1:
        return local
    largest = max(sizes)
    padded = local.new_zeros((largest, *local.shape[1:]))
    padded[:len(local)] = local
    out = local.new_empty((total, *local.shape[1:]))
    if strategy is None:
        parts = all_gather_rows(padded).split(largest)
    else:  # world_size x largest x ...
        parts = strategy.all_gather(padded.to(strategy.root_device)).to(local.device)
    for r, part in enumerate(parts):
        for i, start in enumerate(_block_starts(total, r, world_size, block)):
            rows = min(block, total - start)
            out[start:start + rows] = part[i * block:i * block + rows]
    return out


def log_identical(pl_module: LightningModule, metrics: dict[str, float], **log_kwargs) -> None:
    """Log epoch-level values that are already the same on every rank.

    ``sync_dist`` with ``max`` leaves identical values unchanged, makes them identical if they
    were not, and keeps them usable by ModelCheckpoint / EarlyStopping on every rank.
    """
    for name, value in metrics.items():
        pl_module.log(name, float(value), on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max",
                      **log_kwargs)
