"""Atomic checkpoints: the Lightning ``CheckpointIO`` every shortcutlab fit saves with.

Lightning's ``TorchCheckpointIO`` serialises the checkpoint in memory, then copies it onto the
destination through an fsspec transaction whose temporary file lies elsewhere: a full disk
leaves a truncated checkpoint under its final name (seen: 7.9 of 19.6 MB, "failed finding
central directory"), and a failed copy over ``last.ckpt`` would destroy the run's resume point.
:class:`AtomicCheckpointIO` serialises in memory too, then writes through
:func:`lightning_mods.checkpointing.atomic_files.write_atomically` (a temporary file beside the checkpoint,
fsync, ``os.replace``): every checkpoint is whole or absent, the previous one of that name
intact, and a disk error is a one-line :class:`~lightning_mods.checkpointing.atomic_files.DiskWriteError`.

:class:`BackgroundCheckpointIO` is the one a fit gets: the training loop waits only while the
checkpoint is copied to host memory (every tensor, GPU ones through one synchronisation, and the
structure around them), then a background thread serialises and writes it atomically. One write
at a time: a save that comes while the previous one is still writing waits for it, and removals
of older checkpoints are queued behind the writes, so a file is never deleted before its
successor is whole. The writes are finished before the fit ends (the strategy's teardown), after
a pre-emption checkpoint (SIGTERM, SIGINT, SIGUSR1) and at interpreter exit; a write that failed
(a full disk) is raised at the next save or at the end, as the one-line
:class:`~lightning_mods.checkpointing.atomic_files.DiskWriteError`.

Writes go to the background while a fit runs (from :func:`install`, which the reliability
callbacks call when a fit sets up, to the strategy's teardown): a ``trainer.save_checkpoint``
after ``fit`` returns writes at once, so the file is there for the next line that reads it.
Inside a fit, read a checkpoint just saved through the strategy's ``checkpoint_io`` (which
waits) or after :func:`finish_writes`.

Installed by the reliability callbacks (:func:`install`) when the strategy still has Lightning's
default; ``--trainer.plugins=lightning_mods.checkpointing.checkpoint_io.AtomicCheckpointIO`` keeps
the writes in the loop. Remote paths (``s3://`` ...) keep Lightning's fsspec path.
"""
from __future__ import annotations

import contextlib
import copy
import io
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch
from fsspec.utils import get_protocol
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

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


def host_snapshot(checkpoint: dict[str, Any], pool: Optional[list[torch.Tensor]] = None) -> dict[str, Any]:
    """A copy of ``checkpoint`` that shares nothing with the live training state: every tensor
    copied to host memory (one synchronisation for those on an accelerator), every container and
    value around them deep-copied. ``pool``: host buffers of an earlier snapshot that is no longer
    read, reused in the same order (page-locked for CUDA tensors: a fast, asynchronous copy);
    it is filled with this snapshot's buffers."""
    on_accelerator: set[torch.device] = set()
    copies: dict[int, torch.Tensor] = {}  # a tensor under two names (tied weights) stays one
    reused = iter(list(pool or []))
    if pool is not None:
        pool.clear()

    def buffer_for(tensor: torch.Tensor) -> torch.Tensor:
        candidate = next(reused, None)
        if candidate is not None:
            if (candidate.shape, candidate.dtype, candidate.stride()) == (tensor.shape, tensor.dtype, tensor.stride()):
                return candidate
        pinned = tensor.device.type == "cuda"
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu",
                                   pin_memory=pinned)

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in copies:
            if tensor.device.type != "cpu":
                on_accelerator.add(tensor.device)
            if pool is None or tensor.is_sparse or tensor.layout != torch.strided:
                copies[id(tensor)] = tensor.detach().to("cpu", non_blocking=True, copy=True)
            else:
                copies[id(tensor)] = buffer_for(tensor).copy_(tensor.detach(), non_blocking=True)
                pool.append(copies[id(tensor)])
        return copies[id(tensor)]

    copied = apply_to_collection(checkpoint, torch.Tensor, to_host)
    for device in on_accelerator:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:
            torch.accelerator.synchronize(device)
    memo: dict[int, Any] = {}
    apply_to_collection(copied, torch.Tensor, lambda t: memo.setdefault(id(t), t))  # the copies stay as they are
    return copy.deepcopy(copied, memo)


class BackgroundCheckpointIO(AtomicCheckpointIO):
    """:class:`AtomicCheckpointIO` whose serialising and writing run in a background thread, from a
    host snapshot taken when the save is asked for (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: list[Future] = []
        self._buffers: list[torch.Tensor] = []  # the last snapshot's host buffers, reused once it is written
        self.background = True  # off after teardown (a fit's end), on again at install

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.wait()  # one write at a time (and the buffers free again); a failed one is raised here
        if storage_options is not None or get_protocol(str(path)) != "file" or not self.background:
            return super().save_checkpoint(checkpoint, path, storage_options)
        with contextlib.suppress(OSError):  # now, as a write in the loop would: Lightning links last.ckpt into it
            Path(path).parent.mkdir(parents=True, exist_ok=True)  # (a failure is the write's one-line error)
        snapshot = host_snapshot(checkpoint, self._buffers)
        self._submit(AtomicCheckpointIO.save_checkpoint, self, snapshot, path)

    def remove_checkpoint(self, path: Any) -> None:
        if get_protocol(str(path)) != "file":
            return super().remove_checkpoint(path)
        self._submit(AtomicCheckpointIO.remove_checkpoint, self, path)  # runs after the write before it

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.wait()
        return super().load_checkpoint(path, *args, **kwargs)

    def _submit(self, function: Any, *args: Any) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending.append(self._executor.submit(function, *args))

    def wait(self) -> None:
        """Block until the writes and removals queued are done; raise the first error if one failed."""
        pending, self._pending = self._pending, []
        for task in pending:
            task.result()

    def teardown(self) -> None:
        self.background = False  # until the next fit's install: saves after it are on disk at once
        self._buffers = []  # page-locked host memory, not kept between fits
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def finish_writes(trainer: Any) -> None:
    """Wait for ``trainer``'s background checkpoint write, if one is in progress."""
    writer = getattr(trainer.strategy, "checkpoint_io", None)
    if isinstance(writer, BackgroundCheckpointIO):
        writer.wait()


def install(trainer: Any) -> None:
    """Give ``trainer``'s strategy a :class:`BackgroundCheckpointIO` when it has Lightning's default
    ``TorchCheckpointIO`` (a plugin of the user's own stays)."""
    strategy = trainer.strategy
    if type(strategy.checkpoint_io) is TorchCheckpointIO:
        strategy.checkpoint_io = BackgroundCheckpointIO()
    if isinstance(strategy.checkpoint_io, BackgroundCheckpointIO):
        strategy.checkpoint_io.background = True
