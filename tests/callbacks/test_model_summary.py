"""RichModelSummaryWithoutFlops: Lightning's Rich summary without the FLOPs column, its rows and
parameter counts those of a hand-built module."""
from __future__ import annotations

import warnings

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TwoLayers(LightningModule):
    """8 + 17 trainable parameters, a frozen Linear(2, 2) of 6 in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 2)
        self.second = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
        self.frozen = nn.Linear(2, 2).requires_grad_(False).eval()

    def training_step(self, batch, batch_idx):
        return self.second(self.frozen(self.first(batch[0]))).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_model_summary_has_no_flops_column(tmp_path, capsys):
    from callbacks.reporting.model_summary import RichModelSummaryWithoutFlops

    loader = DataLoader(TensorDataset(torch.randn(2, 3)), batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                callbacks=[RichModelSummaryWithoutFlops(max_depth=1)], default_root_dir=tmp_path).fit(TwoLayers(), loader)
    out = capsys.readouterr().out
    assert "FLOPs" not in out
    header = next(line for line in out.splitlines() if "Name" in line)
    assert [cell.strip() for cell in header.split("┃")[1:-1]] == ["", "Name", "Type", "Params", "Mode"]
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in out.splitlines() if "│" in line]
    assert rows == [["0", "first", "Linear", "8", "train"], ["1", "second", "Sequential", "17", "train"],
                    ["2", "frozen", "Linear", "6", "eval"]]
    for line in ("Trainable params: 25", "Non-trainable params: 6", "Total params: 31", "Modules in train mode: 5",
                 "Modules in eval mode: 1"):
        assert line in out, line
