"""A full disk or a broken file never costs a run (items 1, 2, 3 and 5), with real
faults: a small tmpfs that fills during a fit (skipped where it cannot be mounted), a write that
fails part-way, checkpoints truncated at several offsets, a checkpoint folder removed mid-run."""
from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from commands import lightning_cli as cli
from commands import sweep
from lightning_mods import exit_statuses
from lightning_mods.checkpointing import atomic_files
from lightning_mods.checkpointing.checkpoint_io import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config=configs/digits_mae.yaml", "--trainer.enable_progress_bar=false", "--model.network.depth=2",
        "--model.network.decoder_depth=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
        "--trainer.check_val_every_n_epoch=1"]


# --- the atomic write itself ---------------------------------------------------------------------
def test_a_write_that_fails_part_way_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"the previous, good checkpoint")
    monkeypatch.setattr(atomic_files, "last_good_checkpoint", tmp_path / "epoch=0.ckpt")

    def half_then_full(f):  # noqa: ANN001
        f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(atomic_files.DiskWriteError) as err:
        atomic_files.write_atomically(target, half_then_full, size=5000)
    assert target.read_bytes() == b"the previous, good checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file left
    message = str(err.value)
    assert "\n" not in message
    assert re.fullmatch(rf"cannot write {re.escape(str(target))}: no space left on the device \(needs 5,000 bytes, "
                        rf"[\d,]+ free\); the last good checkpoint is {re.escape(str(tmp_path / 'epoch=0.ckpt'))}; "
                        r"nothing of this file was left on disk", message), message


@pytest.mark.parametrize("code, words", [(errno.EDQUOT, "disk quota exceeded"), (errno.EROFS, "read-only file system"),
                                         (errno.EACCES, "permission denied")])
def test_every_disk_error_is_one_line(tmp_path, monkeypatch, code, words):
    def fail_sync(fd: int) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(atomic_files.os, "fsync", fail_sync)  # NFS reports a full quota at fsync
    with pytest.raises(atomic_files.DiskWriteError, match=words):
        atomic_files.write_text_atomically(tmp_path / "report.json", "{}")
    assert list(tmp_path.iterdir()) == []


def test_the_checkpoint_io_writes_a_whole_loadable_file_and_records_it(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.arange(4.0)}, "epoch": 3}, tmp_path / "a" / "x.ckpt")
    assert torch.load(tmp_path / "a" / "x.ckpt", weights_only=True)["epoch"] == 3
    assert atomic_files.last_good_checkpoint == tmp_path / "a" / "x.ckpt"


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_whole_file_gets_the_permissions_open_gives_under_the_umask(tmp_path, umask):
    """Checkpoints, summaries and exports a colleague sharing the folder can read, as Lightning's
    own files (``open()``'s 0666 less the umask), not the temporary file's private 0600."""
    before = os.umask(umask)
    try:
        with open(tmp_path / "by_open.txt", "w") as f:  # how Lightning writes hparams.yaml, metrics.csv
            f.write("x")
        atomic_files.write_text_atomically(tmp_path / "summary.json", "{}")
        AtomicCheckpointIO().save_checkpoint({"epoch": 1}, tmp_path / "last.ckpt")
    finally:
        os.umask(before)
    wanted = (tmp_path / "by_open.txt").stat().st_mode & 0o777
    assert wanted == 0o666 & ~umask
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "summary.json", tmp_path / "last.ckpt")} == {
        "summary.json": wanted, "last.ckpt": wanted}


# --- a file system that really fills --------------------------------------------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    """Mount a tmpfs (root only; skipped where mounting is not allowed) and a function that sizes it."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    mounted = []

    def sized(size: int) -> Path:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
        mounted.append(mount)
        return mount

    yield sized
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def run_fit(shortcutlab: list[str], *args: str) -> subprocess.CompletedProcess:
    """``shortcutlab fit`` in a process of its own (``shortcutlab``: the warm CLI's command)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([*shortcutlab, "fit", *TINY, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)


@pytest.mark.slow
def test_a_filling_disk_ends_the_fit_in_one_line_with_every_checkpoint_whole(tmp_path, small_tmpfs, warm_shortcutlab):
    probe = run_fit(warm_shortcutlab, "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path / 'size'}")
    assert probe.returncode == 0, probe.stderr[-2000:]
    size = next((tmp_path / "size").rglob("last.ckpt")).stat().st_size
    # room for two checkpoints and a half: the epoch-0 files fit, the third write of epoch 1 does not
    disk = small_tmpfs(int(2.5 * size) + 64 * 1024)
    done = run_fit(warm_shortcutlab, "--trainer.max_epochs=30", f"--trainer.default_root_dir={disk}")
    assert done.returncode == exit_statuses.DISK_ERROR, (done.stdout[-2000:], done.stderr[-3000:])
    line = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert re.fullmatch(r"shortcutlab: error: cannot write \S+\.ckpt: no space left on the device \(needs [\d,]+ "
                        r"bytes, [\d,]+ free\); the last good checkpoint is \S+\.ckpt; nothing of this file was "
                        r"left on disk", line), line
    leftovers = [p for p in disk.rglob("*") if p.is_file() and p.name.endswith(".tmp")]
    assert leftovers == []
    checkpoints = sorted(disk.rglob("*.ckpt"))
    assert checkpoints, "the first epoch's checkpoints were lost"
    for path in checkpoints:  # every checkpoint on disk is whole
        assert "state_dict" in torch.load(path, weights_only=True, map_location="cpu"), path
    named = Path(re.search(r"the last good checkpoint is (\S+\.ckpt)", line).group(1))
    assert named.is_file()


# --- resume past broken checkpoints --------------------------------------------------------------------
def write_checkpoint(path: Path, step: int, mtime: int) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"w": torch.full((2000,), float(step))}, "global_step": step}, path)
    os.utime(path, ns=(mtime, mtime))
    return path.read_bytes()


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.99])
def test_sweep_resumes_past_a_truncated_newest_checkpoint(tmp_path, capsys, keep):
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints" / "epoch=3-step=40.ckpt", 40, 1_000_000_000)
    good = run / "checkpoints" / "last.ckpt"
    write_checkpoint(good, 50, 2_000_000_000)
    newest = run / "checkpoints" / "latest.ckpt"
    data = write_checkpoint(newest, 60, 3_000_000_000)
    newest.write_bytes(data[: int(len(data) * keep)])  # a save cut short
    os.utime(newest, ns=(3_000_000_000, 3_000_000_000))
    assert sweep.resumable_checkpoint(run) == good
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith(f"    skipped {newest}: ")
    assert printed[0].endswith("; trying the next newest checkpoint")
    assert f"skipped {newest}: not a loadable torch checkpoint (" in printed[0]  # the reader's reason follows


def test_no_loadable_checkpoint_starts_fresh(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert sweep.resumable_checkpoint(tmp_path) is None
    assert sweep.resumable_checkpoint(tmp_path / "nothing") is None


# --- a checkpoint folder that disappears ------------------------------------------------------------
class RemoveCheckpointsAfterEpoch0(Callback):
    def on_train_epoch_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        if trainer.current_epoch == 1:
            import shutil

            from lightning_mods.checkpointing.checkpoint_io import finish_writes

            finish_writes(trainer)  # removed between writes (a removal during one is retried once, not raced here)
            shutil.rmtree(trainer.checkpoint_callback.dirpath)


@pytest.mark.slow
def test_a_checkpoint_folder_removed_mid_run_is_made_again(tmp_path):
    out = cli.main(["fit", *TINY, "--trainer.max_epochs=3", f"--trainer.default_root_dir={tmp_path}",
                    "--trainer.callbacks+=test_disk_faults.RemoveCheckpointsAfterEpoch0"])
    last = Path(out.trainer.checkpoint_callback.dirpath) / "last.ckpt"
    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == 6
    assert json.dumps(out.trainer.checkpoint_callback.best_model_path).endswith('latest.ckpt"')


def test_a_folder_removed_while_a_file_is_written_is_made_again(tmp_path):
    import shutil

    target = tmp_path / "checkpoints" / "last.ckpt"
    attempts = []

    def write(f):  # noqa: ANN001
        attempts.append(1)
        if len(attempts) == 1:  # the folder goes, temporary file and all, before the rename
            shutil.rmtree(target.parent)
        f.write(b"whole")
    atomic_files.write_atomically(target, write)
    assert target.read_bytes() == b"whole" and len(attempts) == 2



def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    """A SIGKILL mid-write leaves ``.last.ckpt.<...>.tmp``; the next write into the folder removes
    it, and leaves a live writer's file, another program's file and a recent file of unknown writer."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from lightning_mods.checkpointing.atomic_files import STALE_SECONDS, write_bytes_atomically

    # a real writer killed while its temporary file is open
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); "
            "from lightning_mods.checkpointing.atomic_files import write_atomically; "
            "write_atomically(sys.argv[2], lambda f: (f.write(b'x'), f.flush(), print('writing', flush=True), "
            "time.sleep(60)))")
    writer = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).resolve().parents[2]),
                               str(tmp_path / "last.ckpt")], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    killed = sorted(tmp_path.glob(".last.ckpt.*.tmp"))
    assert len(killed) == 1
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    writer.stdout.close()
    host = socket.gethostname()
    live = tmp_path / f".epoch1.ckpt.{host}-{os.getpid()}.abcdefgh.tmp"  # this process: alive
    unknown_old = tmp_path / ".last.ckpt.k2j4h5g6.tmp"  # written before writers were named
    unknown_new = tmp_path / ".latest.ckpt.q1w2e3r4.tmp"
    other_program = tmp_path / ".notes.swp"
    for path in (live, unknown_old, unknown_new, other_program):
        path.write_bytes(b"")
    old = time.time() - STALE_SECONDS - 60
    os.utime(unknown_old, (old, old))
    write_bytes_atomically(tmp_path / "latest.ckpt", b"new")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([live.name, unknown_new.name, other_program.name, "latest.ckpt"])
