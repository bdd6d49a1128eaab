"""Tiny runs for the callbacks' tests: a module with BatchNorm and dropout whose every step draws
from the global RNG (``TinyNet``), one whose features are its inputs (``Passthrough``), class
blobs as a datamodule with a bank and a validation set, a CPU trainer, and the per-block table's
rows of one evaluation."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mods.evaluation.over_depth import read_table


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")


# --- tiny module and data following docs/contracts.md -------------------------------------
class TinyNet(LightningModule):
    """Encoder with BatchNorm and dropout, trained to reconstruct noisy inputs: every training
    step draws from the global RNG (noise, dropout), like MAE masking."""

    def __init__(self, in_dim: int = 6, width: int = 12, dropout: float = 0.2, noise: float = 0.3,
                 lr: float = 0.05) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(nn.Linear(in_dim, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(dropout))
        self.layer2 = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())
        self.decoder = nn.Linear(width, in_dim)
        self.num_features = width
        self.noise, self.lr = noise, lr

    def forward_intermediates(self, x: torch.Tensor, indices=None, intermediates_only: bool = False):  # noqa: ANN001
        """A user's own module meets the feature contract with timm's call and nothing of ours."""
        h1 = self.layer1(x)
        blocks = [h1, self.layer2(h1)]
        picked = blocks if indices is None else [blocks[i] for i in indices]
        return picked if intermediates_only else (blocks[-1], picked)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_intermediates(x, intermediates_only=True)[-1]

    def training_step(self, batch, batch_idx):
        x = batch[0]
        loss = ((self.decoder(self.forward_features(x + self.noise * torch.randn_like(x))) - x) ** 2).mean()
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", ((self.decoder(self.forward_features(batch[0])) - batch[0]) ** 2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def class_blobs(n: int, num_classes: int, dim: int, seed: int, spread: float = 0.3):
    """``n`` points around ``num_classes`` fixed random centres (the same centres for every seed)."""
    centres = torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(1234)) * 2
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % num_classes
    return centres[labels] + spread * torch.randn(n, dim, generator=g), labels


class TinyData(LightningDataModule):
    """``bank_dataset`` = ``train_dataset`` (no augmentation), ``val_dataset`` held out."""

    def __init__(self, n_train: int = 48, n_val: int = 21, num_classes: int = 3, dim: int = 6,
                 batch_size: int = 8, shuffle: bool = True, spread: float = 0.3) -> None:
        super().__init__()
        self.num_classes, self.batch_size, self.num_workers, self.shuffle = num_classes, batch_size, 0, shuffle
        self.train_dataset = self.bank_dataset = TensorDataset(*class_blobs(n_train, num_classes, dim, 0, spread))
        self.val_dataset = TensorDataset(*class_blobs(n_val, num_classes, dim, 1, spread))

    def train_dataloader(self):
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_dataset, batch_size=self.batch_size)


def tiny_trainer(tmp_path, callbacks, max_epochs=2, **kwargs) -> Trainer:
    defaults = dict(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                    num_sanity_val_steps=2, log_every_n_steps=1)
    defaults.update(kwargs)
    return Trainer(callbacks=callbacks, **defaults)


def metric(trainer: Trainer, name: str) -> float:
    return float(trainer.callback_metrics[name])


# --- training with the callbacks ----------------------------------------------------------
class RecordGrads(Callback):
    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append([p.grad.clone() for p in pl_module.parameters()])


def fit_tiny(tmp_path, extra_callbacks, max_epochs=2, **trainer_kwargs):
    seed_everything(0)
    model, data, recorder = TinyNet(), TinyData(), RecordGrads()
    trainer = tiny_trainer(tmp_path, [recorder, *extra_callbacks], max_epochs=max_epochs, limit_train_batches=3,
                           **trainer_kwargs)
    trainer.fit(model, datamodule=data)
    return model, recorder.grads, trainer


class Passthrough(LightningModule):
    """Features = the inputs; a dummy loss so that ``fit`` runs."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.num_features = 6

    def forward_features(self, x):
        return x

    def training_step(self, batch, batch_idx):
        return (self.scale - 1.0) ** 2

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class HandBuiltBlocks(Passthrough):
    """Block 1: the inputs; block 2: their first coordinate only (rank one)."""

    def forward_intermediates(self, x, indices=None, intermediates_only=False):  # noqa: ANN001
        blocks = [x, x * torch.tensor([1.0, 0, 0, 0, 0, 0])]
        return blocks if intermediates_only else (self.forward_features(x), blocks)


def fit_blocks(tmp_path, callbacks, module=None, data=None, max_epochs=2):
    seed_everything(0)
    trainer = tiny_trainer(tmp_path, callbacks, max_epochs=max_epochs, limit_train_batches=3)
    module = module or TinyNet()
    trainer.fit(module, datamodule=data or TinyData())
    return trainer, module


def rows_by_block(path: Path, epoch: int) -> dict[int, dict]:
    return {row["block"]: row for row in read_table(path) if row["epoch"] == epoch}
