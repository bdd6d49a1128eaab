"""RunSummary: the table and summary.json after fit, accuracies as the logged fractions, paths
whole in a log file; TensorBoard's hyper-parameter view shows the final metrics, not
Lightning's placeholder ``hp_metric`` of -1 (read back from the event file as TensorBoard reads it)."""
from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch.utils.data import DataLoader, TensorDataset

from callbacks.measurement.effective_rank import EffectiveRank
from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.online_probe import OnlineLinearProbe
from callbacks.reporting.run_summary import RunSummary, format_value
from helpers.tiny_runs import TinyData, TinyNet, metric, tiny_trainer


def test_run_summary_shows_accuracies_as_the_logged_fractions():
    assert format_value("knn/top1", 0.48611) == "0.4861"
    assert format_value("online_probe/val_top1", 1.0) == "1.0000"
    assert format_value("val/top5", 0.125) == "0.1250"
    assert format_value("rank/effective_rank", 31.3912) == "31.39"
    assert format_value("val/loss", 0.000123456) == "0.0001235"
    assert format_value("knn/top1", None) == "-"


def test_run_summary_table_and_file(tmp_path, capsys):
    seed_everything(0)
    summary = RunSummary()
    trainer = tiny_trainer(tmp_path, [OnlineLinearProbe(), KNNEvaluator(k=5), EffectiveRank(), summary,
                                      ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)],
                           max_epochs=1, limit_train_batches=2, enable_checkpointing=True)
    trainer.fit(TinyNet(), datamodule=TinyData())
    out = capsys.readouterr().out
    for text in ("knn/top1", "online_probe/val_top1", "rank/effective_rank", "last checkpoint", "last.ckpt"):
        assert text in out, text
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["metrics"]["knn/top1"] == pytest.approx(metric(trainer, "knn/top1"))
    assert written["last_checkpoint"].endswith("last.ckpt")
    assert written["epochs"] == 1 and written["steps"] == 2


@pytest.mark.parametrize("callbacks,best,last", [
    ([dict(filename="latest", every_n_epochs=1, save_top_k=1)], None, "latest.ckpt"),  # the ResNet configs'
    ([dict(monitor="val/loss", filename="best"), dict(filename="latest", save_top_k=1)], "best.ckpt", "latest.ckpt"),
    ([dict(filename="latest", save_top_k=1), dict(monitor="val/loss", filename="best", save_last=True)],
     "best.ckpt", "last.ckpt"),
])
def test_the_summary_names_a_checkpoint_best_only_when_a_metric_chose_it(tmp_path, callbacks, best, last):
    """An unmonitored checkpoint is the run's last, never its best, whichever comes first."""
    seed_everything(0)
    summary = RunSummary()
    checkpoints = [ModelCheckpoint(dirpath=tmp_path / "ckpt", **kwargs) for kwargs in callbacks]
    trainer = tiny_trainer(tmp_path, [summary, *checkpoints], max_epochs=2, limit_train_batches=2,
                           enable_checkpointing=True)
    trainer.fit(TinyNet(), datamodule=TinyData())
    written = json.loads((tmp_path / "summary.json").read_text())
    if best is None:
        assert written["best_checkpoint"] is None
    else:
        assert written["best_checkpoint"].endswith(best)
    assert written["last_checkpoint"].endswith(last)


def test_run_summary_paths_stay_whole_in_a_log_file(tmp_path, capsys):
    """Not a terminal (a job's log file): each path on one line, copyable, however long."""
    deep = tmp_path / ("a_rather_long_folder_name_" * 4) / "checkpoints"
    summary = RunSummary()
    summary.summary = {"metrics": {"knn/top1": 0.5}, "best_checkpoint": str(deep / "epoch=9-step=100.ckpt"),
                       "last_checkpoint": str(deep / "last.ckpt"), "pictures": None, "log_dir": str(tmp_path),
                       "epochs": 10, "steps": 100}
    summary.print_table()
    lines = capsys.readouterr().out.splitlines()
    for path in (deep / "last.ckpt", deep / "epoch=9-step=100.ckpt"):
        assert any(str(path) in line for line in lines), (str(path), lines)


class Regression(LightningModule):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        self.log("val/loss", torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_hyperparameter_view_shows_the_final_metrics(tmp_path):
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 3), torch.randn(16, 1)), batch_size=4)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    trainer = Trainer(max_epochs=2, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[RunSummary(metrics=["val/loss"], summary_file=None)])
    trainer.fit(Regression(), data, data)
    final = float(trainer.callback_metrics["val/loss"])

    events = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    assert "hp_metric" not in events.Tags()["scalars"]  # no -1 placeholder
    content = events.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert [m.name.tag for m in experiment.metric_infos] == ["val/loss"]
    assert {h.name for h in experiment.hparam_infos} >= {"width"}
    last = events.Scalars("val/loss")[-1]
    assert last.step == trainer.global_step and abs(last.value - final) < 1e-6
