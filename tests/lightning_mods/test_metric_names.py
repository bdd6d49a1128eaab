"""One metric vocabulary (lightning_mods/evaluation/metric_names.py): every family logs the same names,
accuracies as fractions, checked against accuracies computed here by hand; the README's
"Metrics" table lists the same names."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from datamodules.spiral import Spiral
from lightning_mods.evaluation import metric_names
from lightning_mods.linear_probe import LinearProbe
from lightning_mods.backbone.residual_mlp import ResidualMLP
from lightning_mods.spiral_classifier import SpiralClassifier

warnings.filterwarnings("ignore", ".*does not have many workers.*")
README = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def quiet_trainer(tmp_path, **kwargs) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False, default_root_dir=tmp_path, **kwargs)


class Coordinates(nn.Module):
    """A backbone whose features are its 2-D inputs."""

    num_features = 2

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_linear_probe_logs_test_names_and_fractions(tmp_path):
    # six points, three classes; the head is set by hand so that its predictions are known:
    # logits = features @ W^T + b, W = identity on classes 0 and 1, class 2 scores 0.5
    points = torch.tensor([[2.0, 0], [0, 2.0], [0, 0], [2.0, 0], [0.1, 0], [0, 0.2]])
    labels = torch.tensor([0, 1, 2, 1, 2, 2])  # predicted 0, 1, 2, 0, 2, 2: five of six right
    probe = LinearProbe(Coordinates(), num_classes=3, batch_norm=False)
    with torch.no_grad():
        probe.head.linear.weight.copy_(torch.tensor([[1.0, 0], [0, 1.0], [0, 0]]))
        probe.head.linear.bias.copy_(torch.tensor([0.0, 0.0, 0.5]))
    loader = DataLoader(TensorDataset(points, labels), batch_size=4)
    logged = quiet_trainer(tmp_path).test(probe, loader, verbose=False)[0]
    assert sorted(logged) == ["test/loss", "test/top1", "test/top5"]
    assert logged["test/top1"] == pytest.approx(5 / 6)
    assert logged["test/top5"] == pytest.approx(1.0)  # top-k with k = min(5, 3 classes)
    logits = points @ torch.tensor([[1.0, 0, 0], [0, 1.0, 0]]) + torch.tensor([0.0, 0.0, 0.5])
    assert logged["test/loss"] == pytest.approx(nn.functional.cross_entropy(logits, labels).item(), rel=1e-6)


def test_spiral_logs_the_classifier_names(tmp_path):
    seed_everything(0)
    data = Spiral(num_points=256, val_points=64, grid_size=8, batch_size=64)
    model = SpiralClassifier(ResidualMLP(depth=2, width=4), lr=0.05)
    trainer = quiet_trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    assert sorted(trainer.logged_metrics) == ["train/loss_epoch", "train/loss_step", "train/top1", "val/loss", "val/top1"]
    points, labels = data.val_dataset.tensors
    with torch.no_grad():
        accuracy = (model.eval()(points).argmax(dim=1) == labels).double().mean().item()
    assert float(trainer.callback_metrics["val/top1"]) == pytest.approx(accuracy)  # a fraction
    tested = trainer.test(model, datamodule=data, verbose=False)[0]
    assert sorted(tested) == ["test/loss", "test/top1"]


def readme_metrics_table() -> dict[str, str]:
    """``{name: unit}`` of docs/metrics.md's "## Metrics" table (a row may name several metrics)."""
    section = README.read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, str] = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if row.startswith("|") and len(cells) == 3 and "`" in cells[0]:
            for name in re.findall(r"`([^`]+)`", cells[0]):
                table[name] = cells[2]
    return table


def test_readme_metrics_table_is_the_vocabulary():
    table = readme_metrics_table()
    constants = {value for name, value in vars(metric_names).items() if name.isupper() and isinstance(value, str)}
    assert constants <= set(table), constants - set(table)
    for name in metric_names.FRACTIONS:
        assert table[name] == "fraction in [0, 1]", name
