"""When a callback works, stated by every callback shortcutlab ships in one class attribute,
``cost``: ``shortcutlab --help`` and ``docs/callbacks.md`` show it, and the benchmarks count the
operations of every ``per step`` one (``python -m benchmarks --only ops``).

A callback of one's own states it the same way::

    class Mine(Callback):
        cost = PER_VALIDATION
"""
from __future__ import annotations

PER_STEP = "per step"  # in every training step (or predict batch): kept to a few fused calls
PER_VALIDATION = "per validation"  # at the validations it is scheduled for
PER_CHECKPOINT = "per checkpoint"  # when a checkpoint is written or read
ONCE = "once"  # at set-up, at the end of the run, or when it fails

COSTS = (PER_STEP, PER_VALIDATION, PER_CHECKPOINT, ONCE)
