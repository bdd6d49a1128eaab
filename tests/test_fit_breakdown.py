"""benchmarks/fit_breakdown.py, the parts that run without a GPU: the callback clock counts the
seconds inside each callback's hooks from the warm-up on (a hand-made callback that sleeps a known
time), the throughput record counts the images after the warm-up, and the rows are the fractions
of the step alone."""
from __future__ import annotations

import json
import time

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, TensorDataset

from helpers.line_module import Line

from benchmarks.fit_breakdown import Breakdown, CallbackClock, Case, Throughput, rows


class Sleeps(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        time.sleep(0.02)

    def on_train_epoch_end(self, trainer, pl_module):  # noqa: ANN001
        time.sleep(0.05)


def test_the_clock_and_the_record_count_from_the_warm_up_on(tmp_path):
    clock, record = CallbackClock(str(tmp_path / "clock.json"), 2), Throughput(str(tmp_path / "rate.json"), 2)
    trainer = Trainer(max_steps=8, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, callbacks=[Sleeps(), clock, record],
                      default_root_dir=tmp_path)
    points = DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=4)
    trainer.fit(Line(), points)
    timed = json.loads((tmp_path / "clock.json").read_text())
    assert timed["steps"] == 6  # steps 2..7
    sleeps = timed["seconds"]["Sleeps"]
    assert 6 * 0.02 <= sleeps["per step"] < 6 * 0.02 + 0.5
    assert 2 * 0.05 <= sleeps["per epoch"] < 2 * 0.05 + 0.5  # two epoch ends after the warm-up
    rate = json.loads((tmp_path / "rate.json").read_text())
    assert rate["steps"] == 8 and rate["steps_per_epoch"] == 4 and rate["images_per_s"] > 0


def test_rows_are_fractions_of_the_step_alone():
    case = Case("c", [], 20, 100, "generated")
    out = rows(Breakdown(case, batch_size=128, steps_per_epoch=100, step=200.0, loader=400.0, bare_fit=180.0,
                         shipped_fit=150.0, callback_seconds={"EMA": {"per step": 0.064, "per epoch": 0.0}}))
    values = {row.name: row.median for row in out}
    assert values["the fit as shipped"] == pytest.approx(0.75) and values["the fit without callbacks"] == 0.9
    assert values["the training loader alone (to the device, nothing trained)"] == 2.0
    assert values["callback EMA"] == pytest.approx(0.1)  # 64 ms against 128 images at 200 img/s (0.64 s)
    assert "1.00 epochs (100 steps each)" in out[0].detail


def test_the_step_alone_warms_up_until_two_windows_agree():
    """A step that speeds up from 30 ms by 4 ms a call down to 5 ms (from call 7 on), on a clock
    the steps advance: windows of 2 steps after a warm-up of 1 (48, 32, 16, 10, 10 ms) agree first
    at steps 7-8 and 9-10, and the rate is theirs (4 images in 5 ms)."""
    from benchmarks.fit_breakdown import settled_rate

    now = [0.0]

    def step(index: int) -> None:
        now[0] += max(0.005, 0.03 - 0.004 * index)

    rate, warmup = settled_rate(step, batch_size=4, device=torch.device("cpu"), warmup=1, window=2,
                                clock=lambda: now[0])
    assert warmup == 7  # steps 0..6 before the two agreeing windows
    assert rate == pytest.approx(4 / 0.005)


def test_fits_are_given_as_ratios_to_the_official_loop():
    case = Case("c", [], 20, 100, "generated", peer="mae")
    out = rows(Breakdown(case, batch_size=128, steps_per_epoch=100, step=200.0, step_warmup=60, loader=400.0,
                         peer_loop=160.0, bare_fit=180.0, shipped_fit=120.0))
    by_name = {row.name: row for row in out}
    official = by_name["the official recipe's own training loop (facebookresearch/mae)"]
    assert official.median == pytest.approx(0.8)
    assert by_name["the fit without callbacks"].raw["of_official_loop"] == pytest.approx(1.125)
    assert by_name["the fit as shipped"].raw["of_official_loop"] == pytest.approx(0.75)
    assert "0.75x the official loop" in by_name["the fit as shipped"].detail
    assert "warmed up 60 steps" in out[0].detail


def test_the_captured_step_and_fit_stand_beside_the_eager_ones():
    case = Case("c", [], 20, 100, "generated")
    out = rows(Breakdown(case, batch_size=128, steps_per_epoch=100, step=200.0, loader=400.0, bare_fit=180.0,
                         shipped_fit=150.0, compiled=True, compiled_step=190.0, compile_seconds=40.0,
                         captured_step=260.0, capture_seconds=70.0, captured_fit=195.0))
    by_name = {row.name: row for row in out}
    assert by_name["the network's step alone, captured (CompileNetwork)"].median == pytest.approx(1.3)
    assert "compiling and capturing took 70 s" in by_name["the network's step alone, captured (CompileNetwork)"].detail
    captured_fit = by_name["the fit as shipped, network captured (CompileNetwork)"]
    assert captured_fit.median == pytest.approx(0.975) and "1.30x the fit as shipped" in captured_fit.detail
    failed = rows(Breakdown(case, batch_size=128, step=200.0, shipped_fit=150.0, compiled=True,
                            errors=["network captured: RuntimeError: no graph"]))
    assert {row.name for row in failed} >= {"the network's step alone, captured (CompileNetwork)",
                                            "the fit as shipped, network captured (CompileNetwork)"}
    assert not any("CompileNetwork" in row.name for row in rows(Breakdown(case, batch_size=128, step=200.0)))


def test_past_the_time_limit_no_figure_starts_and_the_rows_say_so(tmp_path):
    """A deadline already passed: nothing is built or run, and every figure's row names the limit;
    a fit running at the limit is stopped there."""
    import time as clock

    from benchmarks.fit_breakdown import TIME_LIMIT, fit, measure
    from benchmarks.settings import Settings

    case = Case("c", ["--config=configs/no-such-config.yaml"], 2, 4, "generated")
    out = rows(measure(case, Settings(), tmp_path, deadline=clock.monotonic() - 1))
    assert out and all(row.median is None and TIME_LIMIT in row.detail for row in out)
    start = clock.perf_counter()
    stopped = fit(["--config=configs/digits_mae.yaml"], tmp_path / "fit", 10 ** 6, "32-true", "cpu", [], timeout=1)
    assert stopped["status"] is None and "stopped at the time limit after 1 s" in stopped["error"]
    assert clock.perf_counter() - start < 30
