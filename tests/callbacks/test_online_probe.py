"""OnlineLinearProbe: it learns separable data and logs its head's own accuracy, its state
round-trips, a head trained at another rate is refused, and the accuracies of a hand-built case
across two ranks are exact (its pieces: test_probe_replay.py, test_probe_rates.py,
test_probe_depth_heads.py)."""
from __future__ import annotations


import pytest
import torch
from lightning.pytorch import seed_everything
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from callbacks.measurement.online_probe import LinearHeads, OnlineLinearProbe
from helpers.tiny_runs import Passthrough, TinyData, metric, tiny_trainer


def test_online_probe_learns_separable_data(tmp_path):
    seed_everything(0)
    probe = OnlineLinearProbe(heads=LinearHeads(lr=0.05), every_n_steps=1, max_samples=None)
    data = TinyData(n_train=96, n_val=30, num_classes=4, spread=0.2)
    trainer = tiny_trainer(tmp_path, [probe], max_epochs=4)
    trainer.fit(Passthrough(), datamodule=data)
    assert metric(trainer, "online_probe/val_top1") >= 0.95
    assert metric(trainer, "online_probe/train_top1") >= 0.8
    # the logged accuracy is the head's accuracy on the validation set
    x, y = data.val_dataset.tensors
    probe.head.eval()
    with torch.no_grad():
        acc = (probe.head(x).argmax(1) == y).float().mean().item()
    assert metric(trainer, "online_probe/val_top1") == pytest.approx(acc)


def test_online_probe_state_dict_round_trip():
    probe = OnlineLinearProbe(heads=LinearHeads(num_classes=3, optimizer="sgd"))
    probe.build_heads(4)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    probe.probe_heads.learn(x, y, {})
    assert probe.steps == 1
    state = probe.state_dict()
    other = OnlineLinearProbe(heads=LinearHeads(num_classes=3, optimizer="sgd", seed=7))
    other.load_state_dict(state)  # before setup: applied when the head is built
    other.build_heads(4)
    for a, b in zip(probe.head.state_dict().values(), other.head.state_dict().values()):
        assert torch.equal(a, b)
    assert str(other.probe_heads.optimizers[0].state_dict()) == str(probe.probe_heads.optimizers[0].state_dict())
    with pytest.raises(ValueError, match="optimizer"):
        OnlineLinearProbe(heads=LinearHeads(optimizer="lamb"))


def test_online_probe_refuses_a_head_trained_at_another_default_rate():
    """A single head's rate is in its state: when the default rate moves (1e-2 -> 2e-2), a
    checkpoint of the old default does not go on silently at the new one."""
    probe = OnlineLinearProbe(heads=LinearHeads(num_classes=3, lr=0.01))
    probe.build_heads(4)
    state = probe.state_dict()
    assert [h["lr"] for h in state["heads"]] == [0.01]
    default = OnlineLinearProbe(heads=LinearHeads(num_classes=3))
    assert default.lrs == [0.02]
    default.load_state_dict(state)
    with pytest.raises(ValueError, match=r"trained at lr \[0.01\], this probe's are \[0.02\]"):
        default.build_heads(4)
    # a single head's earlier layout, written before the rate was saved
    older = {**{k: v for k, v in state.items() if k != "heads"}, "head": state["heads"][0]["head"],
             "optimizer": state["heads"][0]["optimizer"]}
    continued = OnlineLinearProbe(heads=LinearHeads(num_classes=3))
    continued.load_state_dict(older)
    continued.build_heads(4)  # no rate saved: taken to be this probe's
    assert torch.equal(continued.head.linear.weight, probe.head.linear.weight)


def test_online_probe_accuracies_on_a_hand_built_case():
    """An identity head on one-hot features predicts the hot index. Validation as rank 1 of 2 over
    5 samples: it holds samples 1 (hit), 3 (miss) and sample 0 again as padding (a hit that must
    not count), so val_top1 = 1/2 exactly (2/3 if the padding counted)."""
    import contextlib
    from types import SimpleNamespace

    probe = OnlineLinearProbe(heads=LinearHeads(num_classes=3, batch_norm=False), every_n_steps=1)
    probe.build_heads(3)
    with torch.no_grad():
        probe.head.linear.weight.copy_(torch.eye(3))
        probe.head.linear.bias.zero_()
    features = torch.eye(3)[[0, 1, 2, 2, 0]]  # predictions 0, 1, 2, 2, 0
    labels = torch.tensor([0, 1, 0, 0, 1])
    module, logged = Passthrough(), {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, float(value))
    module.log_dict = lambda values, **kwargs: logged.update({k: float(v) for k, v in values.items()})
    dataset = TensorDataset(features, labels)
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2, rank=1,
                                                                          shuffle=False))
    trainer = SimpleNamespace(sanity_checking=False, val_dataloaders=loader,
                              precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext))

    probe.on_train_batch_end(trainer, module, None, (features[:4], labels[:4]), 0)
    probe.on_train_epoch_end(trainer, module)
    assert logged["online_probe/train_top1"] == 0.5  # hits on samples 0 and 1 of 4, before the step
    with torch.no_grad():  # back to the identity head the step moved
        probe.head.linear.weight.copy_(torch.eye(3))
        probe.head.linear.bias.zero_()
    probe.on_validation_epoch_start(trainer, module)
    for i, batch in enumerate(loader):
        probe.on_validation_batch_end(trainer, module, None, batch, i)
    probe.on_validation_epoch_end(trainer, module)
    assert logged["online_probe/val_top1"] == 0.5
