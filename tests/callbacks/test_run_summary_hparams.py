"""TensorBoard's hyper-parameter view shows a run's final metrics (those of RunSummary), not
Lightning's placeholder ``hp_metric`` of -1: read back from the event file as TensorBoard reads it."""
from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch.utils.data import DataLoader, TensorDataset

from callbacks.reporting.run_summary import RunSummary


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
