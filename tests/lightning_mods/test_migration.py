"""One versioned module upgrades the checkpoints of earlier releases: each step names the
releases that wrote the old layout and the release that drops it, and this test fails at that
release until the step is gone."""
from __future__ import annotations

import configparser
import math
from pathlib import Path

import torch

from lightning_mods.checkpointing import migration
from lightning_mods.checkpointing.checkpoint_io import AtomicCheckpointIO
from lightning_mods.checkpointing.rebuild import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
RELEASE_0_1_0 = ROOT / "tests" / "data" / "written_by_0_1_0" / "last.ckpt"


def old_rank_state() -> dict:
    return {"callbacks": {"EffectiveRank{'per_block': True}": {"history": [
        {"epoch": 0, "step": 2, "metrics": {}, "profile": [3.0, 2.0, 1.5]}]}}}


def test_no_step_outlives_the_release_that_drops_it():
    version = configparser.ConfigParser()
    version.read(ROOT / "setup.cfg")
    assert migration.steps_due(version["metadata"]["version"]) == []
    assert migration.steps_due("0.3.0") == list(migration.STEPS)
    assert all(step.written_by and step.what for step in migration.STEPS)


def test_an_effective_rank_history_without_entropies_gets_one_nan_per_block():
    checkpoint = old_rank_state()
    assert migration.upgrade(checkpoint) == ["entropy_profile"]
    (entry,) = next(iter(checkpoint["callbacks"].values()))["history"]
    assert len(entry["entropy_profile"]) == 3 and all(math.isnan(h) for h in entry["entropy_profile"])
    assert entry["profile"] == [3.0, 2.0, 1.5]
    assert migration.upgrade(checkpoint) == []  # once upgraded, nothing more to do


def test_a_fits_checkpoint_io_upgrades_the_file_it_resumes_from(tmp_path):
    path = tmp_path / "old.ckpt"
    torch.save({"state_dict": {}, **old_rank_state()}, path)
    loaded = AtomicCheckpointIO().load_checkpoint(path)
    (entry,) = next(iter(loaded["callbacks"].values()))["history"]
    assert len(entry["entropy_profile"]) == 3


def test_a_release_0_1_0_checkpoint_needs_no_upgrade_and_a_train_position_without_its_order_resumes_unchecked():
    assert migration.upgrade(load_checkpoint(RELEASE_0_1_0)) == []  # read by load_checkpoint: upgraded already
    assert migration.datamodule_state({"train_position": {"epoch": 1, "batches": 0}})["data_order"] is None
    kept = {"seed": 0, "batch_size": 8, "world_size": 1, "num_samples": 16}
    assert migration.datamodule_state({"train_position": None, "data_order": kept})["data_order"] == kept
