"""The online probe's replay (callbacks/measurement/online_probe/replay.py): the ring buffer's rows by age
on hand-worked cases, its state round trip, and the probe's head steps on replayed rows
against a float64 reference of the same SGD steps."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from callbacks.measurement.online_probe.replay import FeatureReplay
from callbacks.measurement.online_probe import LinearHeads, OnlineLinearProbe, Replay


def numbered(values: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features whose one column is the sample's number, labels the number too."""
    tensor = torch.tensor(values)
    return tensor.float().view(-1, 1), tensor


def sample_numbers(replay: FeatureReplay, first_age: int, count: int) -> list[int]:
    rows = replay.rows(first_age, count)
    features, labels = replay.features.index_select(0, rows), replay.labels.index_select(0, rows)
    assert features.view(-1).long().tolist() == labels.tolist()
    return labels.tolist()


def test_rows_by_age_newest_first_before_and_after_the_ring_wraps():
    replay = FeatureReplay(5)
    replay.add(*numbered([0, 1, 2]))
    assert sample_numbers(replay, 0, 2) == [2, 1]
    assert sample_numbers(replay, 1, 4) == [1, 0, 2]  # only 3 filled: ages 1, 2, 0
    replay.add(*numbered([3, 4, 5, 6]))  # 0 and 1 dropped
    assert replay.filled == 5
    assert sample_numbers(replay, 0, 5) == [6, 5, 4, 3, 2]
    assert sample_numbers(replay, 3, 4) == [3, 2, 6, 5]  # ages 3, 4, 0, 1
    replay.add(*numbered([7, 8, 9, 10, 11, 12, 13]))  # more than it holds: the last 5
    assert sample_numbers(replay, 0, 5) == [13, 12, 11, 10, 9]


def test_state_round_trip_and_a_capacity_mismatch():
    replay = FeatureReplay(4)
    replay.add(*numbered([1, 2, 3, 4, 5]))
    restored = FeatureReplay(4)
    restored.load_state_dict(replay.state_dict(), torch.device("cpu"))
    assert sample_numbers(restored, 0, 4) == sample_numbers(replay, 0, 4) == [5, 4, 3, 2]
    restored.add(*numbered([6]))
    assert sample_numbers(restored, 0, 4) == [6, 5, 4, 3]
    with pytest.raises(ValueError, match="replays 4 samples, this probe 3"):
        FeatureReplay(3).load_state_dict(replay.state_dict(), torch.device("cpu"))
    with pytest.raises(ValueError, match="capacity"):
        FeatureReplay(1)


@pytest.mark.parametrize("settings", [dict(head_batch=1), dict(head_batch=600), dict(head_steps=0)])
def test_head_batch_and_head_steps_are_checked(settings):
    with pytest.raises(ValueError, match="head_batch|head_steps"):
        OnlineLinearProbe(replay=Replay(**settings))


def test_head_batch_and_head_steps_sweep_the_replay_as_asked():
    """every_n_steps=4, replay of 8, head_batch 6, head_steps 2: the 8 samples added are swept by
    2 steps of 6 rows, ages 0-5 then 6, 7, 0, 1, 2, 3 (round the replay again)."""
    sweep = Replay(8, head_batch=6, head_steps=2).sweep(4)
    batches = sweep.batches(sweep.new_replay(), *numbered(list(range(8))))
    assert [labels.tolist() for _, labels in batches] == [[7, 6, 5, 4, 3, 2], [1, 0, 7, 6, 5, 4]]
    assert [features.view(-1).long().tolist() for features, _ in batches] == [[7, 6, 5, 4, 3, 2], [1, 0, 7, 6, 5, 4]]


def test_the_first_probes_sweep_all_there_is():
    """Defaults (head_batch 8 // 2 = 4, head_steps 2) with 3 samples held: each step takes the 3,
    the second from age 4 on (ages 4, 5, 6 modulo 3: samples 1, 0, 2)."""
    sweep = Replay(8).sweep(2)
    assert (sweep.head_batch, sweep.head_steps) == (4, 2)
    batches = sweep.batches(sweep.new_replay(), *numbered([0, 1, 2]))
    assert [labels.tolist() for _, labels in batches] == [[2, 1, 0], [1, 0, 2]]


def test_probe_settings_need_two_samples_per_replayed_step():
    with pytest.raises(ValueError, match=r"replay.samples must give at least 2 samples per head step"):
        OnlineLinearProbe(every_n_steps=4, replay=Replay(samples=7))
    OnlineLinearProbe(every_n_steps=4, replay=Replay(samples=8))
    OnlineLinearProbe(replay=None)


def softmax_cross_entropy_step(weight: np.ndarray, bias: np.ndarray, x: np.ndarray, y: np.ndarray,
                               lr: float) -> tuple[np.ndarray, np.ndarray]:
    """One plain SGD step of a linear softmax classifier on the mean cross-entropy, float64."""
    logits = x @ weight.T + bias
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return weight - lr * p.T @ x, bias - lr * p.sum(axis=0)


class FeaturesAsGiven(torch.nn.Module):
    """A module whose features are its inputs."""

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_probe_sweeps_the_replay_newest_first_one_step_per_training_batch():
    """every_n_steps=2, max_samples=3, replay_samples=6: each probe adds 3 samples, then takes 2
    steps of 3 samples (ages 0-2, then 3-5, wrapping over the samples held). Training batches
    0, 2 and 4 are probed. Reference: the same SGD steps in float64 on the rows those ages name."""
    probe = OnlineLinearProbe(heads=LinearHeads(num_classes=3, lr=0.5, optimizer="sgd", momentum=0.0, batch_norm=False),
                              every_n_steps=2, max_samples=3, replay=Replay(samples=6))
    probe.build_heads(4)
    weight = probe.head.linear.weight.detach().double().numpy().copy()
    bias = probe.head.linear.bias.detach().double().numpy().copy()
    module = FeaturesAsGiven()
    trainer = SimpleNamespace(sanity_checking=False,
                              precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext))
    g = torch.Generator().manual_seed(0)
    held: list[tuple[np.ndarray, int]] = []  # newest first
    for batch_idx in range(6):
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
        probe.on_train_batch_end(trainer, module, None, (x, y), batch_idx)
        if batch_idx == 5:
            probe.on_train_end(trainer, module)  # the last probe's steps wait for its check (or the end)
        if batch_idx % 2:
            continue
        held = [(x[i].double().numpy(), int(y[i])) for i in (2, 1, 0)] + held
        held = held[:6]
        for step in range(2):
            ages = [(3 * step + j) % len(held) for j in range(min(3, len(held)))]
            xs = np.stack([held[a][0] for a in ages])
            ys = np.array([held[a][1] for a in ages])
            weight, bias = softmax_cross_entropy_step(weight, bias, xs, ys, 0.5)
    assert probe.steps == 3
    np.testing.assert_allclose(probe.head.linear.weight.detach().double().numpy(), weight, rtol=0, atol=1e-6)
    np.testing.assert_allclose(probe.head.linear.bias.detach().double().numpy(), bias, rtol=0, atol=1e-6)


def test_samples_waiting_for_their_check_survive_a_checkpoint():
    """A probe's samples wait for its non-finite check until the next probe: a checkpoint taken
    in between holds them, and the restored probe (its head not built yet: sized from the
    features) steps on them as the uninterrupted probe does, to the last bit."""
    import copy

    trainer = SimpleNamespace(sanity_checking=False,
                              precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext))
    settings = dict(heads=LinearHeads(num_classes=3, optimizer="sgd"), every_n_steps=2, max_samples=4,
                    replay=Replay(samples=8))
    probe, module = OnlineLinearProbe(**settings), FeaturesAsGiven()
    g = torch.Generator().manual_seed(0)
    for batch_idx in range(3):  # probes at batches 0 and 2: batch 0's samples stepped on, batch 2's wait
        batch = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
        probe.on_train_batch_end(trainer, module, None, batch, batch_idx)
    assert probe.steps == 1
    state = copy.deepcopy(probe.state_dict())
    restored = OnlineLinearProbe(**settings)
    restored.load_state_dict(state)
    assert restored.head is None
    for p in (probe, restored):
        p.on_train_end(trainer, module)
    assert probe.steps == restored.steps == 2
    for a, b in zip(probe.head.state_dict().values(), restored.head.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(probe.probe_heads.replay.features, restored.probe_heads.replay.features)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_probe_with_a_non_finite_feature_is_skipped_with_a_warning(bad):
    """One non-finite value in one block's features: the heads take no step on that probe (the
    weights stay as they were), a warning says so, and the next finite probe steps again."""
    import copy

    trainer = SimpleNamespace(sanity_checking=False,
                              precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext))
    probe = OnlineLinearProbe(heads=LinearHeads(num_classes=3, optimizer="sgd"), every_n_steps=1, max_samples=None,
                              replay=None)
    module = FeaturesAsGiven()
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    probe.on_train_batch_end(trainer, module, None, batch, 0)
    probe.on_train_end(trainer, module)
    before = copy.deepcopy(probe.head.state_dict())
    poisoned = batch[0].clone()
    poisoned[3, 2] = bad
    probe.on_train_batch_end(trainer, module, None, (poisoned, batch[1]), 1)
    with pytest.warns(UserWarning, match="non-finite features, the heads skip this step"):
        probe.on_train_end(trainer, module)
    assert all(torch.equal(a, b) for a, b in zip(probe.head.state_dict().values(), before.values()))
    probe.on_train_batch_end(trainer, module, None, batch, 2)
    probe.on_train_end(trainer, module)
    assert not torch.equal(probe.head.linear.weight, before["linear.weight"])
