"""The smallest trainable LightningModule, for callback tests: ``y = w x + b`` on 2-D points,
minimising ``y^2`` with SGD, validating ``val/loss``; tests subclass it to add behaviour."""
from __future__ import annotations

import lightning as L
import torch


class Line(L.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.lin = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.lin(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.lin(batch[0]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
