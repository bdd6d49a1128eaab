"""Checkpoints written in the background (lightning_mods/checkpointing/checkpoint_io.py): the file holds
the state of the moment the save was asked for, writes go one at a time, a removal waits for the
write before it, a failed write is raised, and a fit's checkpoints are on disk when it returns."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, TensorDataset

from helpers.line_module import Line

from lightning_mods.checkpointing import atomic_files, checkpoint_io, migration
from lightning_mods.checkpointing.atomic_files import DiskWriteError
from lightning_mods.checkpointing.checkpoint_io import BackgroundCheckpointIO, host_snapshot


class HeldWrites:
    """Stand-in of the background write (serialising, then ``write_atomically``) that waits for
    ``release`` before it starts, then writes: whatever the loop changes meanwhile is changed
    before the checkpoint is serialised."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: BaseException | None = None) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.fail = fail
        self.written: list[str] = []
        real = checkpoint_io.save_torch_atomically

        def held(obj, path):  # noqa: ANN001, ANN202
            self.started.set()
            assert self.release.wait(10), "the test never released the write"
            if self.fail is not None:
                raise self.fail
            self.written.append(str(path))
            return real(obj, path)
        monkeypatch.setattr(checkpoint_io, "save_torch_atomically", held)


def test_the_file_holds_the_state_when_the_save_was_asked_for(tmp_path, monkeypatch):
    held = HeldWrites(monkeypatch)
    io = BackgroundCheckpointIO()
    # a namespace (as jsonargparse's in hyper-parameters) is an object the tensor walk does not rebuild
    weight, steps = torch.zeros(4), SimpleNamespace(seen=[1, 2])
    io.save_checkpoint({"state_dict": {"w": weight}, "nested": {"steps": steps}}, tmp_path / "a.ckpt")
    assert held.started.wait(10)
    weight.add_(5.0)  # the loop goes on while the file is written
    steps.seen.append(3)
    held.release.set()
    io.teardown()
    saved = torch.load(tmp_path / "a.ckpt", weights_only=False)
    assert torch.equal(saved["state_dict"]["w"], torch.zeros(4)) and saved["nested"]["steps"].seen == [1, 2]
    assert atomic_files.last_good_checkpoint == tmp_path / "a.ckpt"


def test_one_write_at_a_time_and_a_removal_after_the_write_before_it(tmp_path, monkeypatch):
    held = HeldWrites(monkeypatch)
    io = BackgroundCheckpointIO()
    (tmp_path / "old.ckpt").write_bytes(b"old")
    io.save_checkpoint({"step": 1}, tmp_path / "new.ckpt")
    assert held.started.wait(10)
    io.remove_checkpoint(tmp_path / "old.ckpt")  # queued: returns while the write is held
    assert (tmp_path / "old.ckpt").exists()  # never deleted before its successor is whole
    second = threading.Thread(target=io.save_checkpoint, args=({"step": 2}, tmp_path / "next.ckpt"))
    second.start()
    second.join(0.3)
    assert second.is_alive() and held.written == []  # waits for the first write, not doubled
    held.release.set()
    second.join(10)
    io.teardown()
    assert held.written == [str(tmp_path / "new.ckpt"), str(tmp_path / "next.ckpt")]
    assert not (tmp_path / "old.ckpt").exists()
    assert torch.load(tmp_path / "next.ckpt", weights_only=False) == {"step": 2, "shortcutlab_version":
                                                                      migration.package_version()}


def test_buffers_reused_by_the_next_snapshot_never_change_a_written_file(tmp_path):
    io = BackgroundCheckpointIO()
    weight = torch.zeros(3)
    io.save_checkpoint({"w": weight, "steps": 1}, tmp_path / "a.ckpt")
    first_buffer = io.arena.buffer
    weight.fill_(2.0)
    io.save_checkpoint({"w": weight, "steps": 2}, tmp_path / "b.ckpt")
    assert io.arena.buffer is first_buffer  # the same host memory, once the first file was whole
    weight.fill_(3.0)
    io.teardown()
    assert torch.equal(torch.load(tmp_path / "a.ckpt")["w"], torch.zeros(3))
    assert torch.equal(torch.load(tmp_path / "b.ckpt")["w"], torch.full((3,), 2.0))


def test_a_failed_background_write_is_raised_at_the_end(tmp_path, monkeypatch):
    held = HeldWrites(monkeypatch, fail=DiskWriteError(28, "cannot write x.ckpt: no space left on the device"))
    held.release.set()
    io = BackgroundCheckpointIO()
    io.save_checkpoint({"step": 1}, tmp_path / "x.ckpt")
    with pytest.raises(DiskWriteError, match="no space left"):
        io.teardown()


def test_the_snapshot_copies_every_tensor_and_container():
    live = {"a": torch.ones(2), "b": [torch.zeros(1), {"c": 3}], "same": None}
    live["same"] = live["a"]  # one tensor under two keys stays one tensor
    snap = host_snapshot(live)
    assert snap["a"].data_ptr() != live["a"].data_ptr() and snap["same"] is snap["a"]
    assert snap["b"] is not live["b"] and snap["b"][1] is not live["b"][1]
    assert torch.equal(snap["b"][0], live["b"][0])


def test_a_fit_s_checkpoint_is_on_disk_and_loadable_when_fit_returns(tmp_path):
    trainer = Trainer(max_epochs=2, limit_val_batches=0, default_root_dir=tmp_path,
                      logger=False, enable_progress_bar=False, enable_model_summary=False)
    checkpoint_io.install(trainer)
    assert isinstance(trainer.strategy.checkpoint_io, BackgroundCheckpointIO)
    model = Line()
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=4))
    (saved,) = (tmp_path / "checkpoints").glob("*.ckpt")
    state = torch.load(saved, weights_only=False)
    assert state["global_step"] == 6
    assert all(torch.equal(state["state_dict"][k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        model.lin.bias.fill_(7.0)
    trainer.save_checkpoint(saved)  # after the fit: written at once, over the file of that name
    assert torch.load(saved, weights_only=False)["state_dict"]["lin.bias"].item() == 7.0
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=4), ckpt_path=saved)
    assert trainer.strategy.checkpoint_io.background is False  # on during the second fit, off after it


def test_a_reserved_arena_holds_the_first_save_and_files_hold_only_their_tensors(tmp_path):
    io = BackgroundCheckpointIO()
    state = {"w": torch.arange(10.0), "b": torch.ones(3, dtype=torch.float64), "n": torch.tensor(7)}
    io.reserve(1 << 20, pinned=False)  # far more than needed: the slack is never written
    io.wait()
    reserved = io.arena.buffer
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    io.teardown()
    assert reserved is not None and io.arena.buffer is not reserved  # teardown lets the memory go
    plain = tmp_path / "plain.ckpt"
    torch.save(state, plain)
    assert (tmp_path / "a.ckpt").stat().st_size < plain.stat().st_size + 1024  # not the 1 MiB arena
    loaded = torch.load(tmp_path / "a.ckpt")
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in state.items())


def test_a_snapshot_into_a_kept_layout_dispatches_the_same_operations_for_3_and_300_tensors():
    from benchmarks.op_counts import OpCounter
    from lightning_mods.checkpointing.checkpoint_io import HostArena

    counts = []
    for n in (3, 300):
        live = {"state": [torch.randn(4, 5) for _ in range(n)], "step": 3}
        arena = HostArena()
        host_snapshot(live, arena)  # lays the arena out
        with OpCounter() as counter:
            snap = host_snapshot(live, arena)
        counts.append(sum(counter.ops.values()))
        assert all(torch.equal(a, b) for a, b in zip(snap["state"], live["state"]))
    assert counts[0] == counts[1] <= 3, counts


def test_a_fit_reserves_the_checkpoints_host_memory_after_its_first_step(tmp_path):
    from callbacks.reliability.exact_resume import ExactResume

    reserved = []

    class Watched(BackgroundCheckpointIO):
        def reserve(self, nbytes: int, pinned: bool) -> None:
            reserved.append((nbytes, pinned))
            super().reserve(nbytes, pinned)

    trainer = Trainer(max_epochs=1, limit_val_batches=0, default_root_dir=tmp_path, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[ExactResume()],
                      plugins=[Watched()])
    model = Line()
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=4))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(reserved) == 1 and reserved[0][1] is False
    assert reserved[0][0] >= 2 * weights  # the module twice (and the optimiser's state, none for SGD)
