"""RemoveLogsOnBadInput: a run refused for bad input before its first step removes the log
folders it created, and only those: not a folder that was there before, not one holding a
checkpoint, not after another kind of failure."""
from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from callbacks.reliability.bad_input_cleanup import RemoveLogsOnBadInput
from lightning_mods.checkpointing.atomic_files import DiskWriteError


def watched(tmp_path):  # noqa: ANN001, ANN201
    logger = CSVLogger(tmp_path / "runs" / "quick")
    trainer = Trainer(logger=logger, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path)
    cleanup = RemoveLogsOnBadInput()
    cleanup.watch(trainer)
    return trainer, cleanup, tmp_path / "runs" / "quick" / "lightning_logs" / "version_0"


@pytest.mark.parametrize("error", [ValueError("bad image"), FileNotFoundError("no data"), DiskWriteError("full")])
def test_the_folders_the_run_made_are_removed_and_those_before_it_kept(tmp_path, error):
    (tmp_path / "runs").mkdir()  # there before the run
    trainer, cleanup, version = watched(tmp_path)
    assert cleanup.created == [version, version.parent, version.parent.parent]
    version.mkdir(parents=True)
    (version / "metrics.csv").write_text("step\n")
    cleanup.on_exception(trainer, None, error)
    assert not (tmp_path / "runs" / "quick").exists() and (tmp_path / "runs").is_dir()


@pytest.mark.parametrize("case", ["checkpoint", "other error", "not watched"])
def test_nothing_is_removed_otherwise(tmp_path, case):
    trainer, cleanup, version = watched(tmp_path)
    version.mkdir(parents=True)
    if case == "checkpoint":
        (version / "last.ckpt").write_bytes(b"")
    if case == "not watched":
        cleanup = RemoveLogsOnBadInput()  # a Trainer built in Python without watch(): it knows no new folder
    cleanup.on_exception(trainer, None, RuntimeError("a bug") if case == "other error" else ValueError("bad"))
    assert version.is_dir()
