"""A training loader's batches prepared on the device one batch ahead, in a background thread.

ImageNet's ``decoder="gpu"`` decodes and augments each batch on the accelerator; done in line,
that work sits between two training steps. :class:`DecodeAhead` takes the next batch from the
loader as soon as the current one is handed out and prepares it in a background thread, on a
CUDA stream of its own, while the step runs; the training loop waits only on an event recorded
after that work (no host synchronisation), and the prepared tensors are marked as used on the
loop's stream, so the caching allocator keeps them until the step is done with them.

The loader's batches are taken in the loop's own thread, in order: with loader workers nothing
changes in what they draw, and the resumable loader counts the batches handed to the loop, not
the one being prepared, so a checkpoint resumes at the first batch not trained. The thread
stops when the epoch ends, when an error is raised (the loader's, or the preparing's, which is
re-raised in the loop), when the loop drops the iterator (an exception, a pre-emption, the end of
the fit) and at :meth:`close`; none is left behind.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection


class DecodeAhead:
    """Iterate ``source``, each batch passed through ``prepare`` (on ``device``) one batch ahead in
    a background thread (see the module docstring)."""

    def __init__(self, source: Iterator[Any], prepare: Callable[[Any], Any], device: torch.device) -> None:
        self.source = source
        self.prepare = prepare
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._executor: Optional[ThreadPoolExecutor] = ThreadPoolExecutor(1, thread_name_prefix="decode-ahead")
        self._next: Optional[Future] = None
        self._started = False

    def __iter__(self) -> "DecodeAhead":
        return self

    def __next__(self) -> Any:
        if self._executor is None:
            raise StopIteration
        try:
            if not self._started:
                self._started = True
                self._submit_next()
            current, self._next = self._next, None
            if current is None:
                raise StopIteration
            self._submit_next()  # the next batch is prepared while the loop trains on this one
            return self._ready(*current.result())
        except BaseException:
            self.close()
            raise

    def _submit_next(self) -> None:
        batch = next(self.source, _END)
        if batch is not _END:
            self._next = self._executor.submit(self._prepare_on_side, batch)

    def _prepare_on_side(self, batch: Any) -> tuple[Any, Optional[torch.cuda.Event]]:
        if self.stream is None:
            return self.prepare(batch), None
        with torch.cuda.stream(self.stream):
            prepared = self.prepare(batch)
            done = torch.cuda.Event()
            done.record(self.stream)
        return prepared, done

    def _ready(self, prepared: Any, done: Optional[torch.cuda.Event]) -> Any:
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)  # the loop's stream waits on the device, the host does not
            apply_to_collection(prepared, torch.Tensor,
                                lambda t: t.record_stream(current) if t.device.type == "cuda" else None)
        return prepared

    def close(self) -> None:
        """Stop: the batch being prepared is finished and dropped, the thread ends."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        pending, self._next = self._next, None
        if pending is not None:
            with contextlib.suppress(BaseException):
                pending.result()
        executor.shutdown(wait=True)

    def __del__(self) -> None:
        self.close()


_END = object()
