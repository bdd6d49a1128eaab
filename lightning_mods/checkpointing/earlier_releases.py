"""A recipe that reads the checkpoints of earlier releases wherever Lightning hands it one: a
mixin for a LightningModule (listed before it), whose ``load_from_checkpoint`` and
``on_load_checkpoint`` bring the checkpoint to this release's layout first
(:mod:`lightning_mods.checkpointing.migration`)."""
from __future__ import annotations

import io
import os
from typing import Any

import torch

from lightning_mods.checkpointing import migration
from lightning_mods.checkpointing.rebuild import read_torch_file


class ReadsEarlierReleases:
    """``load_from_checkpoint`` and resuming (a plain ``Trainer`` too) take an earlier release's file."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``, the file's layout upgraded as it is read."""
        if isinstance(checkpoint_path, (str, os.PathLike)) and os.path.isfile(checkpoint_path):
            checkpoint = read_torch_file(checkpoint_path, "checkpoint", mmap=True)
            if isinstance(checkpoint, dict) and migration.upgrade(checkpoint):
                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                buffer.seek(0)
                checkpoint_path = buffer
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        migration.upgrade(checkpoint)  # before Lightning loads its state_dict
        super().on_load_checkpoint(checkpoint)
