"""A callback for the pre-emption tests' subprocesses: at a known point (after training step
``step``, inside a validation batch of the epoch that step ends, or inside the checkpoint save
made at that step) it announces itself (touches ``ready_file``, suffixed ``.rank<r>`` under DDP)
and waits for the test's real signal, so the signal lands at that point whatever the machine's
speed. Under DDP only the ranks in ``ranks`` wait: the others go on into the step's stop decision,
where they wait for the signalled rank."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from lightning.pytorch import Callback

from callbacks.reliability.preemption import received_signal

POINTS = ("train_step", "validation", "save")


class WaitForSignal(Callback):
    def __init__(self, step: int, ready_file: str, timeout_s: float = 300.0, at: str = "train_step",
                 ranks: Optional[list[int]] = None) -> None:
        if at not in POINTS:
            raise ValueError(f"at must be one of {POINTS}, got {at!r}")
        self.step, self.ready_file, self.timeout_s, self.at, self.ranks = step, Path(ready_file), timeout_s, at, ranks
        self.done = False

    def _wait(self, trainer) -> None:  # noqa: ANN001
        if self.done or trainer.global_step != self.step or trainer.sanity_checking:
            return
        self.done = True
        if self.ranks is not None and trainer.global_rank not in self.ranks:
            return
        ready = self.ready_file if trainer.world_size == 1 else Path(f"{self.ready_file}.rank{trainer.global_rank}")
        ready.touch()
        deadline = time.monotonic() + self.timeout_s
        while received_signal() is None:  # set by PreemptionCheckpoint's handler
            if time.monotonic() > deadline:
                raise RuntimeError(f"WaitForSignal: no signal within {self.timeout_s} s")
            time.sleep(0.02)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if self.at == "train_step":
            self._wait(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        if self.at == "validation":
            self._wait(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # noqa: ANN001
        if self.at == "save":
            self._wait(trainer)
