"""Atomic checkpoints: the Lightning ``CheckpointIO`` every shortcutlab fit saves with.

Lightning's ``TorchCheckpointIO`` serialises the checkpoint in memory, then copies it onto the
destination through an fsspec transaction whose temporary file lies elsewhere: a full disk
leaves a truncated checkpoint under its final name (seen: 7.9 of 19.6 MB, "failed finding
central directory"), and a failed copy over ``last.ckpt`` would destroy the run's resume point.
:class:`AtomicCheckpointIO` serialises in memory too, then writes through
:func:`lightning_mods.checkpointing.atomic_files.write_atomically` (a temporary file beside the checkpoint,
fsync, ``os.replace``): every checkpoint is whole or absent, the previous one of that name
intact, and a disk error is a one-line :class:`~lightning_mods.checkpointing.atomic_files.DiskWriteError`.

Installed by the CLI (``trainer.plugins``) and, for a Trainer built in Python, by the
reliability callbacks (:func:`install`) when the strategy still has Lightning's default.
Remote paths (``s3://`` ...) keep Lightning's fsspec path.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Optional

import torch
from fsspec.utils import get_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_mods.checkpointing import atomic_files


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic (see the module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options (as TorchCheckpointIO)")
        if get_protocol(str(path)) != "file":
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_files.last_good_checkpoint = save_torch_atomically(checkpoint, path)


def save_torch_atomically(obj: Any, path: Any) -> Path:
    """``torch.save(obj, path)``, whole or not at all (:func:`atomic_files.write_atomically`)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getbuffer()
    return atomic_files.write_atomically(path, lambda f: f.write(data), len(data))


def install(trainer: Any) -> None:
    """Give ``trainer``'s strategy an :class:`AtomicCheckpointIO` when it has Lightning's default
    ``TorchCheckpointIO`` (a plugin of the user's own stays)."""
    strategy = trainer.strategy
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
