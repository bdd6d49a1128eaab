"""A train loader whose order is a function of the epoch and that can start mid-epoch, so a
resumed fit sees exactly the batches the uninterrupted one would have seen.

- :class:`EpochShuffle`: a ``RandomSampler`` whose permutation is ``randperm`` of a generator
  seeded ``seed + epoch`` (``set_epoch`` is called by Lightning every epoch), as
  ``DistributedSampler`` does. Being a ``RandomSampler``, Lightning replaces it under DDP by a
  shuffling ``DistributedSampler`` with the same seed rule (``PL_GLOBAL_SEED``).
- :class:`ResumableLoader`: a ``DataLoader`` that counts the batches it handed out in the
  current epoch (:meth:`position`) and, given a ``resume`` position ``{"epoch", "batches"}``,
  sets its sampler to that epoch and skips that many batches of indices (no sample is loaded
  for them) the first time it is iterated. Its base seed for workers comes from its own
  generator, so creating an iterator draws nothing from the global RNG that the model's
  randomness (masks, noise) uses.

The position is saved by :class:`ResumableTrainData` (the datamodules' ``state_dict``) and handed
to the next train loader by its ``load_state_dict``: Lightning restores a datamodule before it
builds the train loader, while the loop state it restores later is too late for a loader that
``configure_optimizers`` already built (to count ``estimated_stepping_batches``). The RNG states are
``callbacks.reliability.exact_resume.ExactResume``'s. With ``num_workers > 0`` the order is still exact;
augmentation draws made in worker processes are not (the workers are seeded afresh on resume).
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Iterator, Optional, Sized

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, RandomSampler

from datamodules._decode_ahead import DecodeAhead
from lightning_mods.checkpointing import migration


def default_shuffle_seed() -> int:
    """The seed Lightning gives its DistributedSampler: ``seed_everything``'s, else 0."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


class EpochShuffle(RandomSampler):
    """Every index once per epoch, in the order ``randperm(n, seed + epoch)``."""

    def __init__(self, data_source: Sized, seed: Optional[int] = None) -> None:
        super().__init__(data_source)
        self.seed = default_shuffle_seed() if seed is None else int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class _SkipFirstBatches:
    """The loader's batch sampler, minus the batches its pending resume position skips."""

    def __init__(self, loader: "ResumableLoader", batch_sampler: Any) -> None:
        self.loader = loader
        self.batch_sampler = batch_sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        # read when the loader's iterator is made (twice with workers: __init__ and _reset)
        return itertools.islice(iter(self.batch_sampler), self.loader._skip, None)


class ResumableLoader(DataLoader):
    """``DataLoader`` that reports its position in the epoch and can resume from one.

    Args (besides DataLoader's):
        resume: ``{"epoch": e, "batches": b}``: the first iteration is epoch ``e`` from its
            batch ``b`` (:meth:`position` of the loader that wrote the checkpoint).
        prepare_ahead: with loader workers, each batch passed through it one batch ahead in a
            background thread (:class:`~datamodules._decode_ahead.DecodeAhead`, on ``ahead_device``);
            without workers (whose draws would then move into that thread) the batches come as
            the workers hand them over.
    """

    def __init__(self, *args: Any, resume: Optional[dict[str, int]] = None,
                 prepare_ahead: Optional[Callable[[Any], Any]] = None, ahead_device: Optional[torch.device] = None,
                 **kwargs: Any) -> None:
        if kwargs.get("generator") is None:
            # the workers' base seed is drawn at every iterator creation: not from the global RNG
            kwargs["generator"] = torch.Generator().manual_seed(default_shuffle_seed())
        super().__init__(*args, **kwargs)
        self._resume = dict(resume) if resume else None
        self.prepare_ahead, self.ahead_device = prepare_ahead, ahead_device
        self._skip = 0
        self._epoch: Optional[int] = None
        self._yielded = 0

    @property
    def _index_sampler(self) -> Any:
        sampler = super()._index_sampler
        return _SkipFirstBatches(self, sampler) if self._auto_collation else sampler

    def _sampler_epoch(self) -> Optional[int]:
        epoch = getattr(self.sampler, "epoch", None)
        return None if epoch is None else int(epoch)

    def __iter__(self) -> Iterator[Any]:
        self._yielded = 0
        if self._resume is not None:
            resume, self._resume = self._resume, None
            if hasattr(self.sampler, "set_epoch"):  # before Lightning's own set_epoch: workers fetch ahead
                self.sampler.set_epoch(int(resume["epoch"]))
            self._skip = self._yielded = min(int(resume["batches"]), len(self))
        try:
            iterator = super().__iter__()
        finally:
            self._skip = 0
        if self.prepare_ahead is not None and self.num_workers > 0:  # the batches' draws stay in the workers
            iterator = DecodeAhead(iterator, self.prepare_ahead, self.ahead_device or torch.device("cpu"))
        return self._count(iterator)

    def _count(self, iterator: Iterator[Any]) -> Iterator[Any]:
        try:
            for i, batch in enumerate(iterator):
                if i == 0:  # Lightning sets the sampler's epoch after creating the iterator
                    self._epoch = self._sampler_epoch()
                self._yielded += 1  # handed to the loop: a batch prepared ahead is not counted yet
                yield batch
        finally:  # the epoch's end, or the loop dropping the iterator: no thread left behind
            if isinstance(iterator, DecodeAhead):
                iterator.close()

    def position(self) -> Optional[dict[str, int]]:
        """``{"epoch", "batches"}`` handed out so far in the epoch being iterated (None before
        the first batch or with a sampler that has no epoch)."""
        if self._epoch is None:
            return None
        return {"epoch": self._epoch, "batches": self._yielded}


class ResumableTrainData:
    """Datamodule mixin: ``state_dict`` holds the train loader's position, ``load_state_dict``
    hands it to the next :meth:`resumable_train_loader`."""

    _resume_position: Optional[dict[str, int]] = None  # from a checkpoint, for the next train loader
    _resume_order: Optional[dict[str, int]] = None  # what that position counts in (see data_order)

    def resumable_train_loader(self, dataset: Any, batch_size: int, **kwargs: Any) -> ResumableLoader:
        """An epoch-shuffled :class:`ResumableLoader` of ``dataset`` (DataLoader ``kwargs``; a
        ``sampler`` given there must draw its order from its ``set_epoch``, as :class:`EpochShuffle`)."""
        resume, self._resume_position = self._resume_position, None
        written, self._resume_order = self._resume_order, None
        if resume is not None and written is not None:
            check_same_data_order(written, data_order(batch_size, self._world_size(), len(dataset)),
                                  mid_epoch=int(resume.get("batches", 0)) > 0)
        sampler = kwargs.pop("sampler", None) or EpochShuffle(dataset)  # another epoch-seeded order, if given
        return ResumableLoader(dataset, batch_size=batch_size, sampler=sampler, resume=resume, **kwargs)

    def _world_size(self) -> int:
        trainer = getattr(self, "trainer", None)
        return int(trainer.world_size) if trainer is not None else 1

    def state_dict(self) -> dict[str, Any]:
        """``{"train_position": {"epoch", "batches"}}``: the next batch to hand out (a finished
        epoch is the next epoch's batch 0)."""
        trainer = getattr(self, "trainer", None)
        loader = getattr(trainer, "train_dataloader", None) if trainer is not None else None
        position = loader.position() if isinstance(loader, ResumableLoader) else None
        if position is None:
            return {}
        if position["batches"] >= trainer.num_training_batches:  # limit_train_batches included
            position = {"epoch": position["epoch"] + 1, "batches": 0}
        return {"train_position": position,
                "data_order": data_order(int(loader.batch_size), self._world_size(), len(loader.dataset))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = migration.datamodule_state(state_dict)
        self._resume_position = state_dict.get("train_position")
        self._resume_order = state_dict["data_order"]


def data_order(batch_size: int, world_size: int, num_samples: int) -> dict[str, int]:
    """What a train position counts in: the shuffle seed (``seed_everything``'s), the batches'
    size, the number of processes sharing the epoch and the number of samples shuffled."""
    return {"seed": default_shuffle_seed(), "batch_size": int(batch_size), "world_size": int(world_size),
            "num_samples": int(num_samples)}


NAMES = {"seed": "seed_everything", "batch_size": "data batch_size", "world_size": "processes (devices x nodes)",
         "num_samples": "the number of training samples"}


def check_same_data_order(written: dict[str, int], current: dict[str, int], mid_epoch: bool) -> None:
    """Resuming in another order than the checkpoint's: mid-epoch a one-line ValueError (the
    position would skip or repeat samples); at an epoch boundary a warning (nothing is skipped,
    but the run no longer draws the uninterrupted run's order, e.g. on another GPU count)."""
    for key, name in NAMES.items():
        if key in written and written[key] != current[key]:
            if mid_epoch:
                raise ValueError(f"--ckpt_path: {name} is {current[key]} here and {written[key]} in the checkpoint, "
                                 "which stopped mid-epoch; its position counts batches of its own data order, so "
                                 "resume with the checkpoint's value (or from an epoch-end checkpoint)")
            rank_zero_warn(f"resuming with {name} {current[key]} instead of the checkpoint's {written[key]}: the "
                           "epochs from here draw another data order than the uninterrupted run would have")
            return
