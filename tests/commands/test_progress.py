"""Progress bars of the long commands: on a terminal only, silent otherwise."""
import io
import sys

import lightning as L
from rich.console import Console
from rich.progress import Progress

from commands._progress import EpochProgress, command_progress, show_progress, tracked
from datamodules.spiral import Spiral
from lightning_mods.backbone.residual_mlp import ResidualMLP
from lightning_mods.spiral_classifier import SpiralClassifier


def test_bars_only_on_a_terminal_and_never_when_quiet(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert show_progress() and not show_progress(quiet=True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert not show_progress()


def test_a_disabled_progress_prints_nothing_and_still_yields_everything(capsys):
    with command_progress(enabled=False) as progress:
        assert list(tracked(progress, range(5), "counting")) == [0, 1, 2, 3, 4]
        assert not progress.tasks  # a finished inner loop removes its line
    assert list(tracked(None, "abc", "no progress")) == ["a", "b", "c"]
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_epoch_bar_counts_the_epochs_of_a_fit(tmp_path):
    progress = Progress(console=Console(file=io.StringIO()))
    bar = EpochProgress(progress, "train")
    trainer = L.Trainer(max_epochs=3, limit_train_batches=2, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[bar], default_root_dir=tmp_path, accelerator="cpu")
    trainer.fit(SpiralClassifier(ResidualMLP(depth=2, width=4)), datamodule=Spiral(num_points=256, batch_size=64))
    task = progress.tasks[0]
    assert (task.completed, task.total) == (3, 3)
    assert task.description.startswith("train (train/loss ")
