"""Where a kNN bank lives and what it costs: its storage (dtype, device), the memory model a run
is checked against before its first feature pass, and the bank's files for scoring again later.

Memory model, per rank, for a bank of ``N`` images embedded by ``W`` ranks, ``B`` banks (the
features, plus one per block with ``blocks``) of widths ``D_b``, queries ``Q`` (the validation
set, shared by every rank, float32):

    bank    = ceil(N / W) x (sum D_b x bytes(dtype) + 8)     on the bank's device
    queries = Q x sum D_b x 4                                on the module's device
    scoring = the scoring budget (``scoring_mib``)           on the module's device

ViT-B/16 on ImageNet-1K with every block (N = 1,281,167, B = 13 banks of 768, Q = 50,000):
the bank is 47.7 GiB in float32 on one process, 5.96 GiB at 8 ranks and 0.75 GiB at 64 (half
that in float16); the queries add 1.86 GiB a rank. A host-memory bank
(``bank_device: cpu``) is shared by the ranks of a node: the check counts it that many times.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from callbacks._utils.distributed import block_shard, block_shard_sizes
from callbacks._utils.memory import free_bytes, size_text
from lightning_mods.checkpointing.atomic_files import write_atomically

BANK_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BANK_DEVICES = (None, "cpu")


class BankTooLarge(ValueError):
    """A bank that would not fit where it is to be kept; its message is one line."""


def shard_rows(total: int, world_size: int, block: int = 1) -> int:
    """The most bank rows a rank keeps when the ranks own whole blocks of ``block`` rows
    (:func:`~callbacks._utils.distributed.block_shard`): at most ``ceil(ceil(total / block) / W) x block``."""
    return max(block_shard_sizes(total, max(1, world_size), block))


def bank_bytes(rows: int, widths: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of ``rows`` bank rows over banks of ``widths``, stored as ``dtype``, with their labels."""
    return rows * (sum(widths) * torch.empty((), dtype=dtype).element_size() + 8)


def bank_shortage(owner: str, total: int, world_size: int, ranks_per_node: int, widths: Sequence[int],
                  dtype: torch.dtype, bank_device: torch.device, queries: int, module_device: torch.device,
                  scoring_bytes: int, block: int = 1) -> Optional[str]:
    """The one line naming the settings that fix it when the memory model (module docstring)
    exceeds the free memory of the bank's or the module's device on this rank; None when it fits
    or free memory cannot be read."""
    bank = bank_bytes(shard_rows(total, world_size, block), widths, dtype)
    on_module = queries * sum(widths) * 4 + scoring_bytes
    needs = {bank_device: bank * (ranks_per_node if bank_device.type == "cpu" else 1)}
    needs[module_device] = needs.get(module_device, 0) + on_module * (ranks_per_node if module_device.type == "cpu" else 1)
    for device, need in needs.items():
        free = free_bytes(device)
        if free is None or need <= free:
            continue
        dtype_name = str(dtype).replace("torch.", "")
        per = f"{ranks_per_node} ranks of this node" if device.type == "cpu" and ranks_per_node > 1 else "each rank"
        return (f"{owner}: the bank needs {size_text(bank)} a rank ({total} images / {world_size} ranks x {sum(widths)} "
                f"features over {len(widths)} banks x {dtype_name}), the queries and scoring {size_text(on_module)}: "
                f"{size_text(need)} for {per} on {device}, which has {size_text(free)} free; "
                f"{fixes(dtype, bank_device, len(widths))}")
    return None


def fixes(dtype: torch.dtype, bank_device: torch.device, banks: int) -> str:
    """The settings that shrink a rank's share, those that apply."""
    found = ["bank_dtype: float16 (half the bank)"] if dtype == torch.float32 else []
    found += ["bank_device: cpu (host memory)"] if bank_device.type != "cpu" else []
    found += ["fewer blocks"] if banks > 1 else []
    return "set " + ", ".join(found + ["scoring_mib lower"]) + ", or run on more ranks"


def shard_file(folder: Path, rank: int, world_size: int) -> Path:
    """``bank-rank00003-of-00008.pt``: rank ``rank``'s bank rows."""
    return folder / f"bank-rank{rank:05d}-of-{world_size:05d}.pt"


QUERIES_FILE = "queries.pt"


def shard_index(saved: dict[str, Any]) -> torch.Tensor:
    """The index in the whole bank of each row of a saved shard: its rank's blocks of ``block_rows``
    rows (:func:`~callbacks._utils.distributed.block_shard`), or, in a file of a release that wrote
    no ``block_rows``, the rows ``rank, rank + W, ...``."""
    rank, world_size, total = int(saved["rank"]), int(saved["world_size"]), int(saved["total"])
    if saved.get("block_rows"):
        return torch.tensor(block_shard(total, rank, world_size, int(saved["block_rows"])), dtype=torch.int64)
    return torch.arange(rank, total, world_size, dtype=torch.int64)


def save_shard(folder: Path, rank: int, world_size: int, total: int, features: torch.Tensor,
               blocks: Optional[list[torch.Tensor]], labels: torch.Tensor, about: dict[str, Any]) -> Path:
    """Write one rank's bank rows (its blocks of ``about["block_rows"]`` rows, see
    :func:`shard_index`) as written, whole or not at all."""
    payload = {"rank": rank, "world_size": world_size, "total": total, "normalized": True,
               "features": features.cpu(), "blocks": None if blocks is None else [b.cpu() for b in blocks],
               "labels": labels.cpu(), **about}
    return write_atomically(shard_file(folder, rank, world_size), lambda f: torch.save(payload, f))


def save_queries(folder: Path, features: torch.Tensor, blocks: Optional[list[torch.Tensor]], labels: torch.Tensor,
                 about: dict[str, Any]) -> Path:
    """Write the (gathered) query features, as computed (not normalised)."""
    payload = {"features": features.cpu(), "blocks": None if blocks is None else [b.cpu() for b in blocks],
               "labels": labels.cpu(), **about}
    return write_atomically(folder / QUERIES_FILE, lambda f: torch.save(payload, f))


def remove_other_shards(folder: Path, world_size: int) -> None:
    """Drop the shard files of an earlier run with another number of ranks (they would not add up)."""
    for path in folder.glob("bank-rank*-of-*.pt"):
        if not path.name.endswith(f"-of-{world_size:05d}.pt"):
            path.unlink(missing_ok=True)
