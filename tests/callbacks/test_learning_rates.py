"""Every run logs its learning rates at the logging cadence (a default callback), and a run without
a logger runs on without them, where Lightning's LearningRateMonitor refuses to start."""
from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from callbacks.reporting.learning_rate import LearningRates
from commands.cli_settings import DEFAULT_CALLBACKS
from helpers.line_module import Line


class Scheduled(Line):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.5)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def fit(tmp_path, callback, logger) -> Trainer:
    trainer = Trainer(max_steps=4, limit_val_batches=0, log_every_n_steps=1, logger=logger, callbacks=[callback],
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      default_root_dir=tmp_path)
    points = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 2)), batch_size=4)
    trainer.fit(Scheduled(), train_dataloaders=points)
    return trainer


def test_each_step_s_rate_is_logged_and_a_run_without_a_logger_runs_on(tmp_path):
    trainer = fit(tmp_path, LearningRates(), CSVLogger(tmp_path))
    rows = list(csv.DictReader(io.StringIO(Path(trainer.logger.log_dir, "metrics.csv").read_text())))
    assert [float(r["lr-SGD"]) for r in rows if r.get("lr-SGD")] == pytest.approx([0.5, 0.25, 0.5 / 3, 0.125])
    assert fit(tmp_path / "quiet", LearningRates(), False).global_step == 4
    with pytest.raises(MisconfigurationException, match="no logger"):  # what the default spares a run
        fit(tmp_path / "lightning", LearningRateMonitor(), False)
    assert {"class_path": "callbacks.reporting.learning_rate.LearningRates"} in DEFAULT_CALLBACKS
