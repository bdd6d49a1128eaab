"""benchmarks/hook_clock.py, the benchmarks' one clock: on a clock that advances one second a
read, a watched hook's calls, a span from epoch start to epoch end, the warm-up and the sums are
what a hand count of the reads gives."""
from __future__ import annotations

import itertools

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import hook_clock
from benchmarks.hook_clock import HookClock
from helpers.line_module import Line


class Probe(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        pass

    def evaluate(self) -> int:
        return 7


def run(monkeypatch, tmp_path, clock: HookClock, probe: Probe, steps: int = 6) -> None:
    ticks = itertools.count()
    monkeypatch.setattr(hook_clock.time, "perf_counter", lambda: float(next(ticks)))
    trainer = Trainer(max_steps=steps, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, callbacks=[clock, probe],
                      default_root_dir=tmp_path, accelerator="cpu")
    trainer.fit(Line(), DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=4))  # 3 steps an epoch


def test_a_watched_hook_and_an_epoch_span_on_a_hand_counted_clock(monkeypatch, tmp_path):
    clock, probe = HookClock(), Probe()
    clock.watch("probe", probe, ["on_train_batch_end"])
    clock.span("epoch", "on_train_epoch_start", "on_train_epoch_end")
    run(monkeypatch, tmp_path, clock, probe)
    # each timed call reads the clock twice in a row: one second
    assert clock.per_call("probe") == [1.0] * 6 and clock.per_epoch("probe", None, 2) == [3.0, 3.0]
    # an epoch: its start read, then three watched calls (two reads each) inside: 7 reads apart
    assert clock.per_call("epoch") == [7.0, 7.0]
    assert [c.epoch for c in clock.calls if c.name == "probe"] == [0, 0, 0, 1, 1, 1]
    assert clock.seconds("probe", ["on_train_batch_end"], epoch=1) == 3.0


def test_nothing_before_the_warm_up_step_and_any_method_can_be_watched(monkeypatch, tmp_path):
    clock, probe = HookClock(from_step=4), Probe()
    clock.watch("probe", probe, ["on_train_batch_end", "on_no_such_hook"])  # a method it lacks is left alone
    clock.watch("evaluate", probe, ["evaluate"])
    run(monkeypatch, tmp_path, clock, probe)
    assert clock.first_timed_step == 4 and clock.per_call("probe") == [1.0, 1.0]  # steps 4 and 5
    assert probe.evaluate() == 7 and clock.per_call("evaluate") == [1.0]
    assert not hasattr(probe, "on_no_such_hook")
