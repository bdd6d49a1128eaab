"""callbacks/reporting/progress_bar.py: the shipped configs' bar shows the training loss, read from the
trainer once every ``log_every_n_steps`` steps, and nothing of it outside training."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from callbacks.reporting.progress_bar import TrainingLossProgressBar
from test_nonfinite_guard import HostReads


def stand_in_trainer(training: bool = True) -> SimpleNamespace:
    return SimpleNamespace(training=training, sanity_checking=False, global_step=0, log_every_n_steps=4, loggers=[],
                           progress_bar_metrics={"val/loss": 0.5}, callback_metrics={})


def test_the_loss_shown_is_read_every_log_every_n_steps():
    bar, trainer, shown, reads = TrainingLossProgressBar(), stand_in_trainer(), [], HostReads()
    for step in range(10):
        trainer.global_step = step
        trainer.callback_metrics = {"train/loss": torch.tensor(float(step))}
        with reads:
            items = bar.get_metrics(trainer, None)
        shown.append(items["train/loss"])
        assert items["val/loss"] == 0.5  # Lightning's own items stay
    assert shown == [0, 0, 0, 0, 4, 4, 4, 4, 8, 8]
    assert reads.count == 3
    trainer.global_step = 0  # a new fit (or a step count that went back): read at once
    trainer.callback_metrics = {"train/loss": torch.tensor(7.0)}
    assert bar.get_metrics(trainer, None)["train/loss"] == 7.0


def test_nothing_is_read_outside_training_or_before_a_loss_exists():
    bar, reads = TrainingLossProgressBar(), HostReads()
    validating = stand_in_trainer(training=False)
    validating.callback_metrics = {"train/loss": torch.tensor(1.0)}
    with reads:
        assert "train/loss" not in bar.get_metrics(validating, None)
        assert "train/loss" not in bar.get_metrics(stand_in_trainer(), None)  # no loss logged yet
    assert reads.count == 0


def test_a_named_run_shows_its_whole_name_not_the_last_four_characters():
    """A sweep's runs are named after their grid values; Lightning's v_num would show ``=1.0``."""
    trainer = stand_in_trainer(training=False)
    trainer.loggers = [SimpleNamespace(version="alpha_min=1.0,seed=2", name="sweep")]
    items = TrainingLossProgressBar().get_metrics(trainer, None)
    assert items["run"] == "alpha_min=1.0,seed=2" and "v_num" not in items
    trainer.loggers = [SimpleNamespace(version=3, name="lightning_logs")]  # numbered: Lightning's own
    assert TrainingLossProgressBar().get_metrics(trainer, None)["v_num"] == 3
