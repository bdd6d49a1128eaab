"""A callback for the pre-emption test's subprocess: it announces that step ``step`` is done
(touches ``ready_file``) and then waits for the test's real signal, so the signal lands at a
known step whatever the machine's speed."""
from __future__ import annotations

import time
from pathlib import Path

from lightning.pytorch import Callback


class WaitForSignal(Callback):
    def __init__(self, step: int, ready_file: str, timeout_s: float = 300.0) -> None:
        self.step, self.ready_file, self.timeout_s = step, Path(ready_file), timeout_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step != self.step:
            return
        self.ready_file.touch()
        deadline = time.monotonic() + self.timeout_s
        while not trainer.received_sigterm:  # set by the signal handlers
            if time.monotonic() > deadline:
                raise RuntimeError(f"WaitForSignal: no signal within {self.timeout_s} s")
            time.sleep(0.02)
