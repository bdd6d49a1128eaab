"""Files a later run reads are written whole or not at all: checkpoints, converted
weights, ``predictions.pt``, a sweep's and a report's JSON.

:func:`write_atomically` writes to a temporary file in the destination's own folder (the same
file system, so the rename cannot turn into a copy), flushes and fsyncs it, renames it onto the
final name with ``os.replace`` (atomic on POSIX) and fsyncs the folder, so a crash or a full disk
leaves either the previous file of that name or the new one, never half of either, and no
temporary file. A process killed while it writes (SIGKILL, a lost node) cannot remove its
temporary file: the next write into that folder does (:func:`remove_leftovers`). The file gets the permissions ``open()`` would give it (``0666`` less the
process's umask, as Lightning's own files), not the temporary file's private ``0600``: a
colleague sharing the folder reads it as they read the run's logs. A write that fails for lack of space, quota, a read-only file system or
permissions raises :class:`DiskWriteError`, whose one-line message names the file, the bytes it
needed, what was free, and the newest checkpoint this process wrote (:data:`last_good_checkpoint`).

Standard library only: the sweep and the report use it without importing torch.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, IO, Optional, Union

import lightning_mods.exit_statuses as exit_statuses

PathLike = Union[str, "os.PathLike[str]"]
DISK_ERRORS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
               errno.EPERM: "operation not permitted"}

last_good_checkpoint: Optional[Path] = None  # the newest checkpoint this process wrote whole

# the temporary file of a write: .<name>.<host>-<pid>.<random>.tmp, so that a later write can tell a
# dead writer's file from a live one's
_HOST = socket.gethostname().replace("/", "_")
_OURS = re.compile(r"^\.(?P<name>.+)\.(?P<host>[^/]+)-(?P<pid>\d+)\.[A-Za-z0-9_]{8}\.tmp$")
_LEGACY = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{8}\.tmp$")  # written before the writer was named
STALE_SECONDS = 15 * 60  # a writer on another host that has not written for this long is gone


class DiskWriteError(OSError):
    """A file could not be written (full disk, quota, read-only, permissions): one line."""

    def __str__(self) -> str:  # the line alone, without OSError's "[Errno 28] " prefix
        return self.strerror or super().__str__()


def free_bytes(folder: Path) -> Optional[int]:
    """Bytes free for this user in ``folder``'s file system (its nearest existing parent's)."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            with contextlib.suppress(OSError):
                return shutil.disk_usage(candidate).free
            return None
    return None


def describe(err: OSError, path: Path, size: Optional[int]) -> str:
    """The one line of a failed write of ``size`` bytes to ``path``."""
    reason = DISK_ERRORS.get(err.errno or 0, err.strerror or str(err))
    free = free_bytes(path.parent)
    needed = f"needs {size:,} bytes" if size is not None else "size unknown"
    space = f", {free:,} free" if free is not None else ""
    good = (f"; the last good checkpoint is {last_good_checkpoint}" if last_good_checkpoint is not None
            else "; no checkpoint of this run was written")
    return f"cannot write {path}: {reason} ({needed}{space}){good}; nothing of this file was left on disk"


def write_atomically(path: PathLike, write: Callable[[IO[bytes]], None], size: Optional[int] = None) -> Path:
    """Write ``path`` whole or not at all: ``write(file)`` fills a temporary file beside it,
    which replaces ``path`` only once flushed and synced. ``size``: the bytes it will take (for
    the error message). Missing folders are created, also when the folder is removed while the
    file is written (once more, from the start)."""
    path = Path(path)
    for attempt in (1, 2):
        try:
            return _write_once(path, write, size)
        except FileNotFoundError:
            if attempt == 2 or path.parent.is_dir():
                raise
    raise AssertionError("unreachable")


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_once(path: Path, write: Callable[[IO[bytes]], None], size: Optional[int]) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if err.errno in DISK_ERRORS:
            raise DiskWriteError(err.errno, describe(err, path, size)) from None
        raise
    remove_leftovers(path.parent)
    tmp: Optional[str] = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{_HOST}-{os.getpid()}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        _sync_folder(path.parent)
    except OSError as err:
        if err.errno in DISK_ERRORS:
            raise DiskWriteError(err.errno, describe(err, path, size)) from None
        raise
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def remove_leftovers(folder: Path, now: Optional[float] = None) -> list[Path]:
    """Remove the temporary files that writers killed mid-write left in ``folder``: those of a
    process of this host that has ended, and those of another host (or of a release that did not
    name its writer) not written to for :data:`STALE_SECONDS`. Returns what it removed."""
    removed = []
    now = time.time() if now is None else now
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            named, legacy, stale = _OURS.match(entry.name), _LEGACY.match(entry.name), False
            if named and named.group("host") == _HOST:
                stale = int(named.group("pid")) != os.getpid() and not _alive(int(named.group("pid")))
            elif named or legacy:
                with contextlib.suppress(OSError):
                    stale = now - entry.stat(follow_symlinks=False).st_mtime > STALE_SECONDS
            else:
                continue
            if stale:
                with contextlib.suppress(OSError):
                    os.remove(entry.path)
                    removed.append(Path(entry.path))
    return removed


def write_bytes_atomically(path: PathLike, data: bytes) -> Path:
    """:func:`write_atomically` of ``data``."""
    return write_atomically(path, lambda f: f.write(data), len(data))


def write_text_atomically(path: PathLike, text: str) -> Path:
    """:func:`write_atomically` of ``text`` (UTF-8)."""
    return write_bytes_atomically(path, text.encode("utf-8"))


def _sync_folder(folder: Path) -> None:
    """Persist the rename (POSIX: the folder's entry); a no-op where folders cannot be opened."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
