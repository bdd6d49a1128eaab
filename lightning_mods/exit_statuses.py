"""The exit statuses of the ``shortcutlab`` commands, in one place (standard library only: the
sweep and the report read them without torch).

A scheduler or a sweep tells the cases apart by them: 0 done, 1 a run of a sweep failed, 2 bad
input, 3 the fit diverged, 4 a write failed (full disk, quota, read-only folder), 5 a rank or
node was lost, and ``128 + signal`` a run stopped by a signal after saving its resumable
checkpoint (143 for SIGTERM, 130 for SIGINT, 138 for SLURM's SIGUSR1)."""
from __future__ import annotations

SWEEP_RUN_FAILED = 1
BAD_INPUT = 2
DIVERGED = 3
DISK_ERROR = 4
LOST_RANK = 5


def stopped_by(signum: int) -> int:
    """The status of a run stopped by signal ``signum``, as a shell reports it."""
    return 128 + int(signum)
