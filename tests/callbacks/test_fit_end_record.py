"""FitEndRecord: fit_end.json says a fit ended normally, and only then."""
from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks.reliability.fit_end_record import FIT_END_FILE, FitEndRecord
from commands._run_metrics import FIT_END_FILE as REPORT_READS
from helpers.line_module import Line


def trainer(tmp_path, max_epochs: int = 2) -> L.Trainer:
    return L.Trainer(max_epochs=max_epochs, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, logger=L.pytorch.loggers.CSVLogger(tmp_path, name="", version="run"),
                     callbacks=[FitEndRecord()])


def loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)


def test_a_finished_fit_writes_its_epochs_and_steps(tmp_path):
    trainer(tmp_path).fit(Line(), loader(), loader())
    assert json.loads((tmp_path / "run" / FIT_END_FILE).read_text()) == {
        "epochs": 2, "steps": 4, "max_epochs": 2, "max_steps": -1}
    assert REPORT_READS == FIT_END_FILE  # the report looks for the file this callback writes


def test_a_crashed_fit_removes_the_record_and_a_refused_one_keeps_it(tmp_path):
    trainer(tmp_path).fit(Line(), loader(), loader())

    class Refused(Line):  # fails while the fit sets up its data: trains nothing
        def train_dataloader(self):
            raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        trainer(tmp_path).fit(Refused(), val_dataloaders=loader())
    assert (tmp_path / "run" / FIT_END_FILE).is_file()

    class Crashes(Line):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        trainer(tmp_path).fit(Crashes(), loader(), loader())
    assert not (tmp_path / "run" / FIT_END_FILE).exists()
