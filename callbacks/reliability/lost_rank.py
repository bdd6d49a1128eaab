"""A lost rank ends the job promptly and says which.

When one DDP process dies (killed, out of memory, a crashed node), the next collective of every
other rank fails: gloo sees the closed connection at once ("Connection reset by peer", 2 s after a
SIGKILL in ``tests/callbacks/test_lost_rank.py``), NCCL through its watchdog. Lightning then ends each
survivor with a multi-line traceback that does not say which rank went. :class:`LostRankReport`
records every rank's host and process id when the fit starts (one ``all_gather_object``), and when
a distributed operation fails, finds the ranks whose process is gone (on this host: from the
process table; ranks on another host are named as unreachable from here). The ``shortcutlab``
command then prints one line and exits with :data:`lightning_mods.exit_statuses.LOST_RANK`, so a scheduler
requeues the job and the requeued job resumes from the last good checkpoint.

The bound on the survivors' exit: a process that dies closes its connections and the others stop
within seconds; a peer that hangs without closing them (a frozen node) is bounded by the process
group's timeout (Lightning's default: 30 minutes; ``--trainer.strategy=DDPStrategy
--trainer.strategy.timeout=0:05:00`` sets it; under NCCL, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
(on by default in torch >= 2.2) turns it into an error instead of a hang).
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
import lightning_mods.exit_statuses as exit_statuses
from callbacks.cost import ONCE

# what a failed collective says when a peer went away (gloo, NCCL, the c10d store)
PEER_FAILURE_WORDS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
                      "NCCL communicator was aborted", "collective operation timeout", "Timed out", "timed out",
                      "remote worker", "DistNetworkError", "DistBackendError")

lost_rank_message: Optional[str] = None  # set by LostRankReport.on_exception; read by the CLI


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` on this host has exited (a zombie not yet reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def looks_like_a_lost_peer(exception: BaseException) -> bool:
    """Whether ``exception`` is a distributed operation failing because a peer went away."""
    dist_errors = tuple(t for t in (getattr(torch.distributed, "DistError", None),) if t is not None)
    text = f"{type(exception).__name__}: {exception}"
    return isinstance(exception, dist_errors) or any(words in text for words in PEER_FAILURE_WORDS)


class LostRankReport(Callback):
    """Name the lost rank, and the newest checkpoint to resume from, when a DDP fit fails because a
    peer process went away (see the module docstring)."""
    cost = ONCE

    def __init__(self) -> None:
        super().__init__()
        self.peers: list[tuple[str, int]] = []  # (host, pid) of every global rank

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        global lost_rank_message
        lost_rank_message = None
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, (socket.gethostname(), os.getpid()))
            self.peers = [tuple(peer) for peer in gathered]

    def lost_ranks(self, me: int, settle_s: float = 3.0) -> tuple[list[int], list[int]]:
        """``(ranks whose process on this host is gone, ranks on other hosts)``. A killed process
        closes its connections before the process table shows it exited: on a loaded machine the
        peers can see the first before the second, so a process table with every peer alive is
        read again for up to ``settle_s`` seconds."""
        host = socket.gethostname()
        local = [(rank, pid) for rank, (peer_host, pid) in enumerate(self.peers) if rank != me and peer_host == host]
        deadline = time.monotonic() + settle_s
        while True:
            gone = [rank for rank, pid in local if process_gone(pid)]
            if gone or not local or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        remote = [rank for rank, (peer_host, _) in enumerate(self.peers) if peer_host != host]
        return gone, remote

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        global lost_rank_message
        if len(self.peers) < 2 or not looks_like_a_lost_peer(exception):
            return
        me = trainer.global_rank
        gone, remote = self.lost_ranks(me)
        if gone:
            who = ", ".join(f"rank {r} (pid {self.peers[r][1]} on {self.peers[r][0]})" for r in gone)
            what = f"{who} {'was' if len(gone) == 1 else 'were'} lost (exited or killed)"
        elif remote:
            hosts = sorted({self.peers[r][0] for r in remote})
            what = (f"a rank on another host was lost or cut off: one of ranks {', '.join(map(str, remote))} "
                    f"({', '.join(hosts)})")
        else:
            what = "a peer's connection failed though every rank's process on this host is alive"
        checkpoint = newest_checkpoint(trainer)
        resume = f"; resume from {checkpoint}" if checkpoint is not None else "; no checkpoint was written yet"
        lost_rank_message = (f"{what} at step {trainer.global_step}; rank {me} stops too (exit status "
                             f"{exit_statuses.LOST_RANK}: requeue the job){resume}")


def newest_checkpoint(trainer: Trainer) -> Optional[Path]:
    """The newest ``.ckpt`` in the checkpoint callbacks' folders (written whole: AtomicCheckpointIO)."""
    folders = {Path(cb.dirpath) for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
    files = [p for folder in folders if folder.is_dir() for p in folder.glob("*.ckpt")]
    return max(files, key=lambda p: p.stat().st_mtime_ns) if files else None
