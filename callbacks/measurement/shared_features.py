"""One feature pass per validation, shared by the evaluation callbacks.

kNN embeds the bank and the validation set, effective rank the validation set, the online
probe scores its heads on the validation set: the same network, the same images, the same
``forward_features`` (and, for per-block evaluations, ``forward_intermediates``). Through
:func:`shared_features` the first of them to ask for a dataset's features runs
:func:`~callbacks._utils.feature_collection.collect_features` and the others read its result.

- **When a result is reused.** Only within one evaluation of one set of weights: the entry
  is stamped with the trainer's stage, step and epoch, the module, the sum of its parameters'
  and buffers' in-place versions (an averaging callback that swaps weights in changes it) and
  the precision's forward context; a request with another stamp computes afresh. The batch
  size is part of the key (a matmul's rounding may depend on it), the loader's workers are not.
- **Blocks.** A callback that will want per-block features says so at ``setup``
  (:func:`will_need`), so the first pass over that dataset collects the blocks for everyone;
  a request without blocks is served from an entry with them.
- **Ranks.** An entry holds this rank's strided shard; a gathered request (the whole set on
  every rank, in dataset order) gathers it once and keeps that too.
- **Memory.** Entries are dropped by :func:`release` (each user calls it in
  ``on_validation_end``, after every callback's ``on_validation_epoch_end``), and whenever the
  stamp changes.

Every callback still works alone: it then runs the pass itself, as before.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, Optional

from torch.utils.data import Dataset

from callbacks._utils.distributed import gather_strided
from callbacks._utils.feature_collection import Features, collect_features, datamodule_dataset, smoke_test_subset

_ENTRIES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()  # trainer -> {stamp, entries}
_NEEDS: "weakref.WeakKeyDictionary[Any, dict[str, bool]]" = weakref.WeakKeyDictionary()  # trainer -> blocks wanted


def will_need(trainer: Any, dataset_name: str, with_blocks: bool) -> None:
    """Declare (at ``setup``) that this trainer's evaluations will read ``dataset_name``'s
    features, with or without the blocks."""
    needs = _NEEDS.setdefault(trainer, {})
    needs[dataset_name] = needs.get(dataset_name, False) or bool(with_blocks)


def release(trainer: Any) -> None:
    """Drop this trainer's shared features (after the evaluation that used them)."""
    _ENTRIES.pop(trainer, None)


@contextlib.contextmanager
def unshared(trainer: Any) -> Iterator[None]:
    """Inside, a request computes its own features, only what it asks for, and keeps nothing:
    the cost of one callback as if it were alone (the benchmarks time it so)."""
    needs, entries = _NEEDS.pop(trainer, None), _ENTRIES.pop(trainer, None)
    try:
        yield
    finally:
        _ENTRIES.pop(trainer, None)
        if needs is not None:
            _NEEDS[trainer] = needs
        if entries is not None:
            _ENTRIES[trainer] = entries


def _stamp(trainer: Any, module: Any) -> tuple:
    versions = sum(t._version for t in module.parameters()) + sum(t._version for t in module.buffers())
    context = type(trainer.precision_plugin).__name__, getattr(trainer.precision_plugin, "precision", None)
    return (str(trainer.state.fn), bool(trainer.sanity_checking), int(trainer.global_step),
            int(trainer.current_epoch), id(module), versions, context)


def shared_features(trainer: Any, module: Any, dataset_name: str, owner: str, batch_size: int, num_workers: int,
                    with_blocks: bool = False, gather: bool = True, dataset: Optional[Dataset] = None) -> Features:
    """``collect_features`` of the datamodule's ``dataset_name`` (``bank_dataset`` or
    ``val_dataset``), computed at most once per evaluation for all the callbacks that ask (see
    the module docstring). Under ``fast_dev_run`` the first batches only, as
    ``collect_features`` callers do. ``dataset`` overrides the lookup (the caller resolved it)."""
    if dataset is None:
        dataset = datamodule_dataset(trainer, dataset_name, owner)
    subset = smoke_test_subset(trainer, dataset, batch_size)
    stamp = _stamp(trainer, module)
    cache = _ENTRIES.get(trainer)
    if cache is None or cache["stamp"] != stamp:
        cache = _ENTRIES[trainer] = {"stamp": stamp, "entries": {}}
    key = (dataset_name, id(dataset), len(subset), batch_size)
    entry = cache["entries"].get(key)
    if entry is None or (with_blocks and entry["local"].blocks is None):
        blocks = with_blocks or _NEEDS.get(trainer, {}).get(dataset_name, False)
        local = collect_features(module, subset, batch_size, num_workers, with_blocks=blocks, gather=False,
                                 forward_context=trainer.precision_plugin.forward_context)
        entry = cache["entries"][key] = {"local": local, "gathered": None}
    if gather and entry["gathered"] is None:
        local, total = entry["local"], len(subset)
        entry["gathered"] = Features(gather_strided(local.features, total), gather_strided(local.labels, total),
                                     None if local.blocks is None else [gather_strided(b, total) for b in local.blocks])
    found = entry["gathered"] if gather else entry["local"]
    return found if with_blocks or found.blocks is None else found._replace(blocks=None)
