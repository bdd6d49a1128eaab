"""Every shipped per-step callback dispatches at most 50 ATen operations a training step on the
quickstart configs as shipped (benchmarks/op_counts.py; on a GPU some 10 us of host time each:
about 1 % of a 50 ms step), so no callback loops over tensors in Python; and the counter counts
what it should on a hand-made callback."""
from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from helpers.line_module import Line

from benchmarks.op_counts import (CONFIGS, FORWARD, OPS_PER_STEP_GOAL, REPO, CallbackOpCount, counted_fit_arguments,
                                  per_step)
from commands import lightning_cli as cli


class ThreeOpsAStep(Callback):
    """Per step: an add, a multiply and a sum (three operations); at the epoch's end many more."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        (torch.ones(2) * 2).sum()  # ones, mul, sum

    def on_train_epoch_end(self, trainer, pl_module):  # noqa: ANN001
        for _ in range(100):
            torch.zeros(1)


def test_the_counter_counts_per_step_hooks_from_the_warm_up_on(tmp_path):
    counter = CallbackOpCount(str(tmp_path / "ops.json"), warmup_steps=2)
    trainer = Trainer(max_steps=6, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, callbacks=[ThreeOpsAStep(), counter],
                      default_root_dir=tmp_path)
    trainer.fit(Line(), DataLoader(TensorDataset(torch.randn(24, 2)), batch_size=4))
    record = json.loads((tmp_path / "ops.json").read_text())
    assert record["steps"] == 4 and record["ops"]["ThreeOpsAStep"] == 12
    assert record["by_op"]["ThreeOpsAStep"] == {"aten.ones": 4, "aten.mul": 4, "aten.sum": 4}


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_shipped_callback_dispatches_at_most_50_operations_a_step(config, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # in this process: the configs' paths are the repository's
    cli.run_reporting_stops(counted_fit_arguments(CONFIGS[config], steps=8, warmup=4, root=tmp_path))
    counted = per_step(tmp_path / "ops.json")
    own = {name: ops for name, ops in counted["per_step"].items() if not name.endswith(FORWARD)}
    over = {name: ops for name, ops in own.items() if ops > OPS_PER_STEP_GOAL}
    assert not over, f"{config}: operations a step over {OPS_PER_STEP_GOAL}: {over}; most: {counted['by_op']}"
    if config == "quickstart MAE":  # the probe's measurement: its forward of the network every 4th step, apart
        forward = counted["per_step"][f"OnlineLinearProbe: {FORWARD}"]
        assert 50 < forward < 120, forward


def test_the_counted_configs_carry_every_per_step_callback():
    """Every shipped callback that works in every step (``cost = PER_STEP``) is in one of the
    configs counted above, as the CLI reads their callback lists."""
    from callbacks.cost import PER_STEP
    from commands import _catalogue as catalogue
    from helpers.composed_configs import declared_callbacks
    from lightning_mods.checkpointing.rebuild import import_path

    per_step = {import_path(found.class_path) for found in catalogue.find("callback") if found.cost == PER_STEP}
    carried = set()
    for args in CONFIGS.values():
        files = [a.split("=", 1)[1].removeprefix("configs/") for a in args]
        carried |= {import_path(c["class_path"]) for f in files for c in declared_callbacks(f)}
    assert {cls.__name__ for cls in per_step - carried} == set()
