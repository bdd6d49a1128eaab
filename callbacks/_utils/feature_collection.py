"""Evaluation features of a whole dataset, gathered across DDP ranks without duplicates (the
feature source of the kNN and effective-rank evaluations of the decay paper, sections 4 and 6).

The module is run through ``forward_features`` (and optionally ``forward_intermediates``,
see docs/contracts.md) in eval mode, under ``torch.no_grad``, with the random number
generators forked: batch-norm running statistics, weights, gradients, the train/eval mode of
every sub-module and the RNG streams of the training run are left exactly as they were.

Under DDP the dataset is cut into batches of consecutive samples and rank ``r`` embeds the batches
``r, r + W, ...`` with a plain sequential sampler (a DistributedSampler would pad with duplicates);
the shards are all-gathered and put back in dataset order. Every batch holds the same samples
whatever the world size, so every feature is computed by the same arithmetic at 1, 2 or 64
processes and every rank holds, bit for bit, the tensors one process would.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, NamedTuple, Optional

import torch
from torch import nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from lightning_mods.evaluation._eval_mode import isolated_eval, module_device
from lightning_mods.evaluation.feature_contract import features_and_blocks, require_blocks

from callbacks._utils.distributed import block_shard, gather_blocks, rank_and_world_size
from callbacks._utils.pass_progress import dataset_pass


class Features(NamedTuple):
    """Features of a dataset in dataset order.

    ``features``: ``N x D`` (float32 unless another :class:`Storage` was asked for); ``labels``:
    ``N`` int64; ``blocks``: one ``N x D_b`` tensor per block (``None`` when block features were
    not asked for).
    """

    features: torch.Tensor
    labels: torch.Tensor
    blocks: Optional[list[torch.Tensor]]


def _split_batch(batch: object) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise ValueError("collect_features: dataset items must be (image, label, ...) pairs, got "
                         f"{type(batch).__name__}")
    return batch[0], torch.as_tensor(batch[1])


class Storage(NamedTuple):
    """How a pass keeps its features: ``dtype`` (float32, bfloat16, float16), ``device`` (None:
    the module's; ``"cpu"``: host memory) and ``normalize`` (each row L2-normalised as it is
    stored, so nothing makes a normalised copy later). Labels stay int64."""

    dtype: torch.dtype = torch.float32
    device: Optional[str] = None
    normalize: bool = False


def _checked_length(module: nn.Module, dataset: Dataset, batch_size: int, num_workers: int, with_blocks: bool) -> int:
    """``len(dataset)``, after one-line errors for the arguments of :func:`collect_features`."""
    if batch_size <= 0:
        raise ValueError(f"collect_features: batch_size must be > 0, got {batch_size}")
    if num_workers < 0:
        raise ValueError(f"collect_features: num_workers must be >= 0, got {num_workers}")
    if with_blocks:
        require_blocks(module, "collect_features: with_blocks")
    if len(dataset) == 0:
        raise ValueError("collect_features: dataset is empty")
    return len(dataset)


def _outputs(module: nn.Module, images: torch.Tensor, with_blocks: bool) -> list[torch.Tensor]:
    """``[features]``, or ``[features, block 1, block 2, ...]``."""
    if with_blocks:
        features, blocks = features_and_blocks(module, images)
        return [features, *blocks]
    return [module.forward_features(images)]


def _store(batch: torch.Tensor, into: torch.Tensor, normalize: bool) -> None:
    """Write ``batch`` into its rows of the kept tensor, L2-normalised when asked: in place for
    float32 (no copy of the batch), through a float32 copy for a narrower dtype (which could
    not hold the unnormalised values)."""
    if not normalize:
        into.copy_(batch)
    elif into.dtype == torch.float32:
        norms = batch.float().norm(dim=1, keepdim=True).clamp_min_(1e-12)  # F.normalize's eps
        into.copy_(batch).div_(norms.to(into.device))
    else:
        into.copy_(F.normalize(batch.float(), dim=1))


def collect_features(
    module: nn.Module,
    dataset: Dataset,
    batch_size: int,
    num_workers: int = 0,
    with_blocks: bool = False,
    gather: bool = True,
    forward_context: Optional[Callable[[], ContextManager]] = None,
    storage: Storage = Storage(),
    trainer: object = None,
    description: str = "features",
) -> Features:
    """Embed ``dataset`` with ``module.forward_features`` (see the module docstring).

    Args:
        module: implements ``forward_features(images) -> B x D`` (and
            ``forward_intermediates(images)`` when ``with_blocks``).
        dataset: items ``(image, label, ...)``, e.g. a datamodule's ``bank_dataset``.
        batch_size, num_workers: of the loader this function builds.
        with_blocks: also collect every block's pooled features.
        gather: ``True``: the whole dataset on every rank, in dataset order. ``False``: only this
            rank's batches ``rank, rank + W, ...`` (no duplicates across ranks), in order.
        forward_context: e.g. ``trainer.precision_plugin.forward_context`` (mixed precision).
        storage: dtype, device and normalisation of the kept features (float32 by default),
            each tensor allocated once, at its final size: the pass holds one copy.
        trainer, description: the progress bar and duration line of the pass
            (:mod:`callbacks._utils.pass_progress`; none without a trainer).
    """
    total = _checked_length(module, dataset, batch_size, num_workers, with_blocks)
    rank, world_size = rank_and_world_size()
    shard = block_shard(total, rank, world_size, batch_size)
    owned = len(shard)
    # a rank without samples (dataset smaller than the world) embeds one to learn the shapes
    device = module_device(module)
    keep_on = torch.device(storage.device) if storage.device is not None else device
    # its own generator: iterating a loader otherwise draws a base seed from the global RNG
    loader = DataLoader(Subset(dataset, shard or [0]), batch_size=batch_size, shuffle=False,
                        num_workers=num_workers, pin_memory=device.type == "cuda", generator=torch.Generator())
    context = forward_context or contextlib.nullcontext
    kept: list[torch.Tensor] = []  # features, then each block's, allocated at the first batch
    labels = torch.empty(owned, dtype=torch.int64, device=keep_on)
    filled = 0
    with isolated_eval(module), dataset_pass(trainer, description, len(loader), owned) as advance:
        for batch in loader:
            images, batch_labels = _split_batch(batch)
            with context():
                outputs = _outputs(module, images.to(device, non_blocking=True), with_blocks)
            if not kept:
                kept = [torch.empty((owned, *out.shape[1:]), dtype=storage.dtype, device=keep_on) for out in outputs]
            rows = min(len(images), owned - filled)
            for out, into in zip(outputs, kept):
                _store(out[:rows], into[filled:filled + rows], storage.normalize)
            labels[filled:filled + rows].copy_(batch_labels[:rows])
            filled += rows
            advance()

    def finish(local: torch.Tensor) -> torch.Tensor:
        return gather_blocks(local, total, batch_size) if gather else local

    return Features(finish(kept[0]), finish(labels), [finish(b) for b in kept[1:]] if with_blocks else None)


def feature_widths(module: nn.Module, dataset: Dataset, with_blocks: bool) -> list[int]:
    """The width of ``forward_features`` (and of every block's pooled features) on ``dataset``'s
    first item: what a pass would keep per image, learnt from one image."""
    with isolated_eval(module):  # the item's read and the forward draw from forked generators
        images, _ = _split_batch(default_collate([dataset[0]]))
        outputs = _outputs(module, images.to(module_device(module)), with_blocks)
    return [int(out[0].numel()) for out in outputs]


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
