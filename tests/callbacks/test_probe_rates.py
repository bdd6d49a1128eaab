"""The online probe's heads and their rates (callbacks/measurement/online_probe/linear_heads.py): the rates and tags of
hand-written settings, bad lists refused, and a list of rates training exactly the heads of the
single-rate runs."""
from __future__ import annotations

import pytest
import torch
from lightning.pytorch import seed_everything

from callbacks.measurement.online_probe import LinearHeads, OnlineLinearProbe
from helpers.tiny_runs import Passthrough, TinyData, tiny_trainer


def fit_tiny_with(tmp_path, callbacks, module, data, max_epochs):
    seed_everything(0)
    trainer = tiny_trainer(tmp_path, callbacks, max_epochs=max_epochs, limit_train_batches=3)
    trainer.fit(module, datamodule=data)
    return trainer


@pytest.mark.parametrize("lr, optimizer, lrs, tags", [
    (None, "adamw", [0.02], [""]),
    (None, "sgd", [0.1], [""]),
    (0.003, "adamw", [0.003], [""]),
    ([0.001, 0.03], "sgd", [0.001, 0.03], ["lr=0.001", "lr=0.03"]),
    ([0.5], "adamw", [0.5], ["lr=0.5"]),  # a list of one still names its rate
])
def test_rates_and_their_tags(lr, optimizer, lrs, tags):
    rates = LinearHeads(lr=lr, optimizer=optimizer)
    assert rates.lrs == lrs and rates.tags() == tags
    assert rates.several == isinstance(lr, list)
    assert rates.given == lr  # the state key names the rate as the settings do (None: the default)


def test_an_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match=r"^OnlineLinearProbe: optimizer must be one of \('adamw', 'sgd'\), got 'lamb'$"):
        LinearHeads(optimizer="lamb")


def test_probe_list_of_rates_trains_the_heads_of_the_single_rate_runs(tmp_path):
    rates = [0.05, 0.01, 0.002]
    data = TinyData(n_train=96, n_val=30, num_classes=4, spread=0.5)
    many = OnlineLinearProbe(heads=LinearHeads(lr=rates), every_n_steps=1, max_samples=None)
    together = fit_tiny_with(tmp_path / "all", [many], Passthrough(), data, max_epochs=3).callback_metrics
    for i, lr in enumerate(rates):
        one = OnlineLinearProbe(heads=LinearHeads(lr=lr), every_n_steps=1, max_samples=None)
        alone = fit_tiny_with(tmp_path / f"lr{lr}", [one], Passthrough(), data, max_epochs=3).callback_metrics
        for a, b in zip(many.probe_heads.heads[i].state_dict().values(), one.head.state_dict().values()):
            assert torch.equal(a, b), lr
        assert float(together[f"online_probe/val_top1@lr={lr:g}"]) == float(alone["online_probe/val_top1"])
        assert float(together[f"online_probe/train_loss@lr={lr:g}"]) == float(alone["online_probe/train_loss"])
    # and the rates did train different heads
    assert not torch.equal(many.probe_heads.heads[0].linear.weight, many.probe_heads.heads[1].linear.weight)


@pytest.mark.parametrize("lr, message", [([], "lr must be > 0, a non-empty list"), ([0.1, 0.1], "lr lists a rate twice"),
                                         ([0.1, -1.0], "lr must be > 0")])
def test_bad_rate_lists(lr, message):
    with pytest.raises(ValueError, match=f"OnlineLinearProbe: {message}"):
        OnlineLinearProbe(heads=LinearHeads(lr=lr))


