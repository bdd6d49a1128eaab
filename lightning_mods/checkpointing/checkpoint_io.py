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

from lightning_mods.checkpointing import atomic_files, migration


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic (see the module docstring), and whose loads
    bring a checkpoint of an earlier release to this one's layout (:mod:`lightning_mods.checkpointing.migration`)."""

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(path, *args, **kwargs)
        migration.upgrade(checkpoint)
        return checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO.save_checkpoint takes no storage_options (as TorchCheckpointIO)")
        checkpoint = migration.stamped(checkpoint)
        if get_protocol(str(path)) != "file":
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_files.last_good_checkpoint = save_torch_atomically(checkpoint, path)


def save_torch_atomically(obj: Any, path: Any) -> Path:
    """``torch.save(obj, path)``, whole or not at all (:func:`atomic_files.write_atomically`)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getbuffer()
    return atomic_files.write_atomically(path, lambda f: f.write(data), len(data))


ALIGN = 64  # bytes: every tensor of a snapshot starts on a cache line of the arena


class HostArena:
    """One flat host buffer that snapshots lay their tensors in, page-locked when they come from
    CUDA (a fast, asynchronous copy), reused save after save: its views are kept while the
    checkpoint's tensors keep their shapes and types, so a save dispatches one multi-tensor copy
    and no per-tensor work. Allocated once, ahead of the first save where :meth:`reserve` is told
    the size (pinning a gigabyte takes seconds)."""

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None
        self._layout: Optional[tuple] = None
        self._views: list[torch.Tensor] = []

    def reserve(self, nbytes: int, pinned: bool) -> None:
        """Hold at least ``nbytes`` (page-locked if ``pinned``)."""
        if self.buffer is None or self.buffer.numel() < nbytes or self.buffer.is_pinned() != pinned:
            self.buffer = torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=pinned)
            self._layout, self._views = None, []

    def views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors of the shapes and types of ``tensors`` (contiguous), laid in the arena,
        which grows (is replaced) when it is too small."""
        layout = tuple((t.shape, t.dtype) for t in tensors)
        if layout == self._layout:
            return self._views
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += aligned_bytes(t)
        self.reserve(max(end, 1), any(t.device.type == "cuda" for t in tensors))
        storage = self.buffer.untyped_storage()
        # each view on a storage slice of its own bytes: torch.save writes those, not the arena
        self._views = [torch.empty(0, dtype=t.dtype).set_(storage[o:o + t.numel() * t.element_size()]).view(t.shape)
                       for o, t in zip(offsets, tensors)]
        self._layout = layout
        return self._views


def aligned_bytes(tensor: torch.Tensor) -> int:
    """The arena bytes ``tensor`` takes: its own, rounded up to :data:`ALIGN`."""
    return -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN


def snapshot_bytes(tensors: list[torch.Tensor]) -> int:
    """The arena bytes a snapshot of ``tensors`` takes."""
    return sum(aligned_bytes(t) for t in tensors)


def host_snapshot(checkpoint: dict[str, Any], arena: Optional[HostArena] = None) -> dict[str, Any]:
    """A copy of ``checkpoint`` that shares nothing with the live training state: every tensor
    copied to host memory (one multi-tensor copy, one synchronisation for those on an
    accelerator), every container and value around them deep-copied. ``arena``: where the host
    copies are laid (:class:`HostArena`, reused from the last snapshot, which must no longer be
    read); without one each tensor gets its own copy."""
    unique: dict[int, torch.Tensor] = {}  # a tensor under two names (tied weights) stays one

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        unique.setdefault(id(tensor), tensor)
        return tensor

    apply_to_collection(checkpoint, torch.Tensor, collect)
    dense = [t for t in unique.values() if not t.is_sparse and t.layout == torch.strided]
    copies: dict[int, torch.Tensor] = {}
    if arena is not None and dense:
        targets = arena.views(dense)
        with torch.no_grad():  # state_dict tensors are detached already: no detach per tensor
            torch._foreach_copy_(targets, dense, non_blocking=True)
        copies.update((id(t), target) for t, target in zip(dense, targets))
    for key, tensor in unique.items():
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", non_blocking=True, copy=True)
    for device in {t.device for t in unique.values() if t.device.type != "cpu"}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:
            torch.accelerator.synchronize(device)
    copied = apply_to_collection(checkpoint, torch.Tensor, lambda t: copies[id(t)])
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
        self.arena = HostArena()  # the last snapshot's host memory, reused once it is written
        self.background = True  # off after teardown (a fit's end), on again at install

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.wait()  # one write at a time (and the buffers free again); a failed one is raised here
        checkpoint = migration.stamped(checkpoint)
        if storage_options is not None or get_protocol(str(path)) != "file" or not self.background:
            return super().save_checkpoint(checkpoint, path, storage_options)
        with contextlib.suppress(OSError):  # now, as a write in the loop would: Lightning links last.ckpt into it
            Path(path).parent.mkdir(parents=True, exist_ok=True)  # (a failure is the write's one-line error)
        snapshot = host_snapshot(checkpoint, self.arena)
        self._submit(AtomicCheckpointIO.save_checkpoint, self, snapshot, path)

    def reserve(self, nbytes: int, pinned: bool) -> None:
        """Allocate the snapshot's host memory in the background now, before the first save needs
        it (queued like a write: a save waits for it)."""
        self._submit(self.arena.reserve, int(nbytes), bool(pinned))

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
        self.arena = HostArena()  # page-locked host memory, not kept between fits
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


def reserve_for_training(trainer: Any) -> None:
    """Have ``trainer``'s background writer allocate the host memory of its checkpoints now: the
    module's state, its optimisers' and room for one more copy of the module (an EMA's), pinned on
    CUDA. Call once the optimisers hold their state (after the first step); the process that
    writes checkpoints only."""
    writer = getattr(trainer.strategy, "checkpoint_io", None)
    if not isinstance(writer, BackgroundCheckpointIO) or not writer.background or not trainer.is_global_zero:
        return
    module_state = [t for t in trainer.lightning_module.state_dict().values() if torch.is_tensor(t)]
    optimizer_state = [v for optimizer in trainer.optimizers for state in optimizer.state.values()
                       for v in state.values() if torch.is_tensor(v)]
    writer.reserve(2 * snapshot_bytes(module_state) + snapshot_bytes(optimizer_state),
                   trainer.strategy.root_device.type == "cuda")

