"""callbacks/training/ema.py: the EMA the diffusion configs use equals torch's ``AveragedModel`` with
``get_ema_avg_fn`` (Lightning's ``EMAWeightAveraging``) bit for bit, buffers and a loaded state
included, and its update reads nothing back to the host."""
from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn
from torch.utils.data import DataLoader, TensorDataset

from callbacks.training.ema import EMA, HostCountedEMAModel
from test_nonfinite_guard import HostReads


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def perturb(model: nn.Module, seed: int) -> None:
    """New weights and batch-norm statistics (and its integer step count), as a training step makes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
        model.train()
        model(torch.randn(5, 4, generator=g))


@pytest.mark.parametrize("use_buffers", [True, False])
def test_updates_equal_torchs_ema_bit_for_bit_without_host_reads(use_buffers):
    model = net()
    ours = HostCountedEMAModel(model, decay=0.9, use_buffers=use_buffers)
    reference = AveragedModel(model, avg_fn=get_ema_avg_fn(0.9), use_buffers=use_buffers)
    reads = HostReads()
    for seed in range(5):
        perturb(model, seed)
        with reads:
            ours.update_parameters(model)
        reference.update_parameters(model)
        for (name, a), b in zip(ours.state_dict().items(), reference.state_dict().values()):
            assert torch.equal(a, b), (seed, name)
    assert reads.count == 0
    assert int(ours.n_averaged) == 5


def test_a_loaded_state_goes_on_as_torchs():
    model = net()
    reference = AveragedModel(model, avg_fn=get_ema_avg_fn(0.8), use_buffers=True)
    for seed in range(3):
        perturb(model, seed)
        reference.update_parameters(model)
    resumed = HostCountedEMAModel(net(), decay=0.8, use_buffers=True)
    resumed.load_state_dict(reference.state_dict())  # n_averaged = 3: the next update averages
    perturb(model, 7)
    resumed.update_parameters(model)
    reference.update_parameters(model)
    for a, b in zip(resumed.state_dict().values(), reference.state_dict().values()):
        assert torch.equal(a, b)


def test_the_callback_trains_as_lightnings(tmp_path):
    """The same fit with EMA and with Lightning's EMAWeightAveraging: equal averaged weights."""
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))

    from lightning.pytorch import LightningModule

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, batch, batch_idx):  # noqa: ANN001
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    averaged = []
    for callback in (EMA(decay=0.7), EMAWeightAveraging(decay=0.7)):
        trainer = Trainer(max_steps=6, callbacks=[callback], logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                          accelerator="cpu")
        trainer.fit(Module(), DataLoader(data, batch_size=4))
        averaged.append(callback._average_model.state_dict())
    assert averaged[0].keys() == averaged[1].keys()
    assert all(torch.equal(averaged[0][k], averaged[1][k]) for k in averaged[0])
