"""The run's folder for each kind of logger, and a logger the package does not know: it gets
the files and one line, once."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from lightning_mods.pictures.grids import log_picture
from lightning_mods.run_outputs import to_loggers
from lightning_mods.run_outputs.run_folder import run_dir


class NotebookLogger(Logger):
    """A logger of the user's own: a name, a version, a save_dir, and nothing that shows images."""

    def __init__(self, save_dir, version="run-7"):  # noqa: ANN001
        super().__init__()
        self._save_dir, self._version = save_dir, version
        self.metrics = []

    @property
    def name(self):
        return "notebook"

    @property
    def version(self):
        return self._version

    @property
    def save_dir(self):
        return self._save_dir

    def log_metrics(self, metrics, step=None):  # noqa: ANN001
        self.metrics.append(metrics)

    def log_hyperparams(self, params, *args, **kwargs):  # noqa: ANN001
        pass


def trainer_with(logger, tmp_path: Path) -> Trainer:  # noqa: ANN001
    return Trainer(logger=logger, default_root_dir=tmp_path / "root", enable_progress_bar=False,
                   enable_model_summary=False, accelerator="cpu")


def test_tensorboard_and_csv_runs_keep_their_version_folder(tmp_path):
    for cls in (TensorBoardLogger, CSVLogger):
        trainer = trainer_with(cls(tmp_path / cls.__name__, name="exp", version=3), tmp_path)
        assert run_dir(trainer) == tmp_path / cls.__name__ / "exp" / "version_3"


def test_another_logger_gets_the_folder_its_checkpoints_go_to(tmp_path):
    trainer = trainer_with(NotebookLogger(str(tmp_path / "nb")), tmp_path)
    assert run_dir(trainer) == tmp_path / "nb" / "notebook" / "run-7"
    trainer = trainer_with(NotebookLogger(None, version=2), tmp_path)  # no save_dir: default_root_dir; int versions
    assert run_dir(trainer) == tmp_path / "root" / "notebook" / "version_2"
    assert run_dir(trainer_with(False, tmp_path)) == tmp_path / "root"


def test_an_unknown_logger_gets_the_files_and_one_line_once(tmp_path, caplog):
    to_loggers._told.discard("NotebookLogger")
    trainer = trainer_with(NotebookLogger(str(tmp_path / "nb")), tmp_path)
    image = np.zeros((4, 5, 3), np.uint8)
    with caplog.at_level(logging.WARNING, logger=to_loggers.__name__):
        first = log_picture(trainer, "a/b", image, step=1)
        second = log_picture(trainer, "a/b", image, step=2)
    lines = [r.getMessage() for r in caplog.records if r.name == to_loggers.__name__]
    assert lines == [f"NotebookLogger gets no pictures, tables or summary from shortcutlab (TensorBoard, CSV, W&B and "
                     f"MLflow do); they are files in {tmp_path / 'nb' / 'notebook' / 'run-7'}"]
    assert first == tmp_path / "nb" / "notebook" / "run-7" / "pictures" / "a_b_step0000001.png"
    assert first.is_file() and second.is_file()


@pytest.mark.parametrize("name, expected", [("knn/top1@k=10", "knn/top1k10"), ("rank/profile@val", "rank/profileval"),
                                            ("val/top1", "val/top1")])
def test_mlflow_names_drop_what_lightning_drops(name, expected):
    assert to_loggers.mlflow_name(name) == expected
