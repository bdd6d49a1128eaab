"""One feature pass per validation, shared by the evaluation callbacks.

kNN embeds the bank and the validation set, effective rank the validation set, the online
probe scores its heads on the validation set: the same network, the same images, the same
``forward_features`` (and, for per-block evaluations, ``forward_intermediates``). One
:class:`SharedEvaluation` per Trainer holds the pass: each measurement callback declares at
``setup`` what it will read (:meth:`SharedEvaluation.of` finds the Trainer's), the first to ask for a
dataset's features runs
:func:`~callbacks._utils.feature_collection.collect_features` and the others read its result.

- **When a result is reused.** Only within one evaluation of one set of weights: the entry
  is stamped with the trainer's stage, step and epoch, the module, the sum of its parameters'
  and buffers' in-place versions (an averaging callback that swaps weights in changes it) and
  the precision's forward context; a request with another stamp computes afresh. The batch
  size is part of the key (a matmul's rounding may depend on it), the loader's workers are not.
- **Blocks.** A callback that will want per-block features says so at ``setup``
  (:meth:`SharedEvaluation.need`), so the first pass over that dataset collects the blocks for everyone;
  a request without blocks is served from an entry with them.
- **Ranks.** An entry holds this rank's shard (its batches of consecutive samples); a gathered
  request (the whole set on every rank, in dataset order) gathers it once, through
  ``trainer.strategy``, and keeps that too.
  The kNN bank is never gathered: each rank scores its own rows.
- **Memory.** Entries are dropped when the validation ends (``on_validation_end``, after every
  callback's ``on_validation_epoch_end`` read them), and whenever the stamp changes.

Every callback still works alone: in a Trainer whose callbacks hold no ``SharedEvaluation``
(the ``shortcutlab`` CLI's defaults carry one), each request runs its own pass and keeps nothing;
nothing is added to the Trainer's callbacks.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import Dataset

from callbacks._utils.distributed import gather_blocks
from callbacks._utils.feature_collection import (Features, Storage, collect_features, datamodule_dataset,
                                                 smoke_test_subset)
from callbacks.cost import PER_VALIDATION


class SharedEvaluation(Callback):
    """The evaluation pass a Trainer's measurement callbacks share (see the module docstring).

    A callback of one's own uses it as the shipped ones do::

        def setup(self, trainer, pl_module, stage):
            SharedEvaluation.of(trainer).need("val_dataset", with_blocks=False)

        def on_validation_epoch_end(self, trainer, pl_module):
            found = SharedEvaluation.of(trainer).features(trainer, pl_module, "val_dataset", "Mine", 128, 0)
    """
    cost = PER_VALIDATION

    def __init__(self) -> None:
        super().__init__()
        self.needs: dict[str, bool] = {}  # dataset name -> blocks wanted
        self._stamp: Optional[tuple] = None
        self._entries: dict[tuple, dict[str, Any]] = {}
        self._keeps = True  # False: a caller's own pass (no Trainer hook would drop what it kept)

    @classmethod
    def of(cls, trainer: Trainer) -> "SharedEvaluation":
        """The Trainer's shared pass: the one among its callbacks (the ``shortcutlab`` CLI's
        defaults carry one), else a pass of the caller's own that keeps nothing (not added to the
        Trainer's callbacks)."""
        for callback in trainer.callbacks:
            if isinstance(callback, cls):
                return callback
        alone = cls()
        alone._keeps = False
        return alone

    def need(self, dataset_name: str, with_blocks: bool) -> None:
        """Declare (at ``setup``) that an evaluation will read ``dataset_name``'s features, with or
        without the blocks: the pass collects what every declared reader wants."""
        self.needs[dataset_name] = self.needs.get(dataset_name, False) or bool(with_blocks)

    def release(self) -> None:
        """Drop the features kept (after the evaluation that read them)."""
        self._stamp, self._entries = None, {}

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.release()  # every reader has read them (on_validation_epoch_end)

    @contextlib.contextmanager
    def unshared(self) -> Iterator[None]:
        """Inside, a request computes its own features, only what it asks for, and keeps nothing:
        the cost of one callback as if it were alone (the benchmarks time it so)."""
        saved = self.needs, self._stamp, self._entries
        self.needs, self._stamp, self._entries = {}, None, {}
        try:
            yield
        finally:
            self.needs, self._stamp, self._entries = saved

    @staticmethod
    def stamp(trainer: Trainer, module: Any) -> tuple:
        """What one set of weights in one evaluation is: stage, step, epoch, the module and its
        tensors' in-place versions (a weight swap changes them), the precision's forward context."""
        versions = sum(t._version for t in module.parameters()) + sum(t._version for t in module.buffers())
        context = type(trainer.precision_plugin).__name__, getattr(trainer.precision_plugin, "precision", None)
        return (str(trainer.state.fn), bool(trainer.sanity_checking), int(trainer.global_step),
                int(trainer.current_epoch), id(module), versions, context)

    def features(self, trainer: Trainer, module: Any, dataset_name: str, owner: str, batch_size: int,
                 num_workers: int, with_blocks: bool = False, gather: bool = True,
                 dataset: Optional[Dataset] = None, storage: Storage = Storage()) -> Features:
        """``collect_features`` of the datamodule's ``dataset_name`` (``bank_dataset`` or
        ``val_dataset``), computed at most once per evaluation for every reader. Under
        ``fast_dev_run`` the first batches only, as ``collect_features`` callers do. ``dataset``
        overrides the lookup (the caller resolved it); ``storage`` how the features are kept
        (another storage is another pass: the kNN bank keeps unit-length rows)."""
        if dataset is None:
            dataset = datamodule_dataset(trainer, dataset_name, owner)
        subset = smoke_test_subset(trainer, dataset, batch_size)
        stamp = self.stamp(trainer, module)
        if stamp != self._stamp:
            self._stamp, self._entries = stamp, {}
        key = (dataset_name, id(dataset), len(subset), batch_size, storage)
        entry = self._entries.get(key)
        if entry is None or (with_blocks and entry["local"].blocks is None):
            blocks = with_blocks or self.needs.get(dataset_name, False)
            local = collect_features(module, subset, batch_size, num_workers, with_blocks=blocks, gather=False,
                                     forward_context=trainer.precision_plugin.forward_context, storage=storage,
                                     trainer=trainer, description=f"{owner}: {dataset_name}")
            entry = self._entries[key] = {"local": local, "gathered": None}
        if gather and entry["gathered"] is None:
            local, total, strategy = entry["local"], len(subset), trainer.strategy
            entry["gathered"] = Features(
                gather_blocks(local.features, total, batch_size, strategy),
                gather_blocks(local.labels, total, batch_size, strategy),
                None if local.blocks is None else [gather_blocks(b, total, batch_size, strategy) for b in local.blocks])
        found = entry["gathered"] if gather else entry["local"]
        if not self._keeps:
            self.release()
        return found if with_blocks or found.blocks is None else found._replace(blocks=None)

