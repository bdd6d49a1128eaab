"""Evaluation features of a whole dataset, gathered across DDP ranks without duplicates (the
feature source of the kNN and effective-rank evaluations of the decay paper, sections 4 and 6).

The module is run through ``forward_features`` (and optionally ``forward_intermediates``,
see docs/contracts.md) in eval mode, under ``torch.no_grad``, with the random number
generators forked: batch-norm running statistics, weights, gradients, the train/eval mode of
every sub-module and the RNG streams of the training run are left exactly as they were.

Under DDP each rank embeds the strided shard ``rank, rank + W, ...`` of the dataset with a
plain sequential sampler (a DistributedSampler would pad with duplicates), the shards are
all-gathered and put back in dataset order, so every rank holds the same tensors as one
process would.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, NamedTuple, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_mods.evaluation._eval_mode import isolated_eval, module_device
from lightning_mods.evaluation.feature_contract import features_and_blocks, require_blocks

from callbacks._utils.distributed import gather_strided, rank_and_world_size, strided_shard


class Features(NamedTuple):
    """Features of a dataset in dataset order.

    ``features``: ``N x D`` float32; ``labels``: ``N`` int64; ``blocks``: one ``N x D_b``
    float32 tensor per block (``None`` when block features were not asked for).
    """

    features: torch.Tensor
    labels: torch.Tensor
    blocks: Optional[list[torch.Tensor]]


def _split_batch(batch: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise ValueError("collect_features: dataset items must be (image, label, ...) pairs, got "
                         f"{type(batch).__name__}")
    return batch[0], torch.as_tensor(batch[1])


def collect_features(
    module: nn.Module,
    dataset: Dataset,
    batch_size: int,
    num_workers: int = 0,
    with_blocks: bool = False,
    gather: bool = True,
    forward_context: Optional[Callable[[], ContextManager]] = None,
) -> Features:
    """Embed ``dataset`` with ``module.forward_features`` (see the module docstring).

    Args:
        module: implements ``forward_features(images) -> B x D`` (and
            ``forward_intermediates(images)`` when ``with_blocks``).
        dataset: items ``(image, label, ...)``, e.g. a datamodule's ``bank_dataset``.
        batch_size, num_workers: of the loader this function builds.
        with_blocks: also collect every block's pooled features.
        gather: ``True``: the whole dataset on every rank, in dataset order. ``False``: only
            this rank's shard ``rank, rank + W, ...`` (no duplicates across ranks), in order.
        forward_context: e.g. ``trainer.precision_plugin.forward_context`` (autocast under
            mixed precision); features are returned as float32 either way.
    """
    if batch_size <= 0:
        raise ValueError(f"collect_features: batch_size must be > 0, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"collect_features: num_workers must be >= 0, got {num_workers}")
    if with_blocks:
        require_blocks(module, "collect_features: with_blocks")
    total = len(dataset)
    if total == 0:
        raise ValueError("collect_features: dataset is empty")
    rank, world_size = rank_and_world_size()
    shard = list(strided_shard(total, rank, world_size))
    owned = len(shard)
    # a rank without samples (dataset smaller than the world) embeds one to learn the shapes
    device = module_device(module)
    # its own generator: iterating a loader otherwise draws a base seed from the global RNG
    loader = DataLoader(Subset(dataset, shard or [0]), batch_size=batch_size, shuffle=False,
                        num_workers=num_workers, pin_memory=device.type == "cuda", generator=torch.Generator())
    context = forward_context or contextlib.nullcontext
    features, labels, blocks = [], [], []
    with isolated_eval(module):
        for batch in loader:
            images, batch_labels = _split_batch(batch)
            images = images.to(device, non_blocking=True)
            with context():
                if with_blocks:
                    batch_features, batch_blocks = features_and_blocks(module, images)
                    blocks.append([b.float() for b in batch_blocks])
                else:
                    batch_features = module.forward_features(images)
                features.append(batch_features.float())
            labels.append(batch_labels.to(device=device, dtype=torch.int64))

    def finish(parts: list[torch.Tensor]) -> torch.Tensor:
        local = torch.cat(parts)[:owned]
        return gather_strided(local, total) if gather else local

    block_features = [finish([b[i] for b in blocks]) for i in range(len(blocks[0]))] if with_blocks else None
    return Features(finish(features), finish(labels), block_features)


def datamodule_dataset(trainer: object, name: str, owner: str) -> Dataset:
    """``trainer.datamodule.<name>`` (``bank_dataset`` or ``val_dataset``, docs/contracts.md).

    A bank not set up yet (only ``validate`` ran ``setup``) is built through the datamodule's
    ``bank_dataloader()``, as the contract allows.
    """
    dm = getattr(trainer, "datamodule", None)
    if dm is None:
        raise ValueError(f"{owner}: needs a LightningDataModule with `{name}` (pass datamodule= to the Trainer)")
    dataset = getattr(dm, name, None)
    if dataset is None and name == "bank_dataset" and hasattr(dm, "bank_dataloader"):
        dm.bank_dataloader()
        dataset = getattr(dm, name, None)
    if dataset is None:
        raise ValueError(f"{owner}: {type(dm).__name__}.{name} is not set (is it set up for this stage?)")
    return dataset


def loader_settings(trainer: object, batch_size: Optional[int], num_workers: Optional[int]) -> tuple[int, int]:
    """``(batch_size, num_workers)``: the given values, else the datamodule's evaluation batch
    size (``eval_batch_size``, then ``batch_size``) and ``num_workers``."""
    dm = getattr(trainer, "datamodule", None)
    if batch_size is None:
        batch_size = getattr(dm, "eval_batch_size", None) or getattr(dm, "batch_size", None) or 256
    if num_workers is None:
        num_workers = getattr(dm, "num_workers", 0) or 0
    return int(batch_size), int(num_workers)


def smoke_test_subset(trainer: object, dataset: Dataset, batch_size: int) -> Dataset:
    """Under ``Trainer(fast_dev_run=n)`` only the first ``n`` batches of ``dataset`` (a smoke
    test runs the evaluation code, not the evaluation); otherwise ``dataset`` itself."""
    runs = getattr(trainer, "fast_dev_run", False)
    if not runs:
        return dataset
    keep = int(runs) * batch_size
    return Subset(dataset, range(keep)) if keep < len(dataset) else dataset
