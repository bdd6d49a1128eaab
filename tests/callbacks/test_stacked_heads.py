"""Probe heads stacked and stepped together (callbacks/measurement/online_probe/_stacked_heads.py) against the same
heads stepped one by one with torch autograd: weights, batch-norm running statistics, the
scored loss and accuracy, and optimiser states after several steps, for AdamW and SGD, with
and without batch norm; the per-head optimiser layout round trip; a fixed number of
operations a step whatever the number of heads."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from benchmarks.op_counts import OpCounter
from callbacks.measurement.online_probe._stacked_heads import StackedHeads
from lightning_mods.evaluation._probe_head import ProbeHead
from lightning_mods.recipe.optim import adamw

WIDTH, CLASSES, SAMPLES, HEADS, STEPS = 6, 4, 10, 3, 5


def optimizer_of(kind: str, head: ProbeHead) -> torch.optim.Optimizer:
    if kind == "adamw":
        return adamw(list(head.parameters()), lr=0.05, weight_decay=0.0)
    return torch.optim.SGD(head.parameters(), lr=0.05, momentum=0.9, weight_decay=0.0)


def onehot(labels: torch.Tensor) -> torch.Tensor:
    """The step's target: one-hot columns times -1/N (built by hand here)."""
    return F.one_hot(labels, CLASSES).float().t() / -len(labels)


def heads_and_data(batch_norm: bool, heads: int = HEADS):
    generator = torch.Generator().manual_seed(0)
    made = [ProbeHead(WIDTH, CLASSES, batch_norm, generator=generator) for _ in range(heads)]
    for head in made:  # a non-zero bias, so that the bias's own gradient matters
        head.linear.bias.data.normal_(0, 0.1, generator=generator)
    data = [([torch.randn(SAMPLES, WIDTH, generator=generator) * (h + 1) + h for h in range(heads)],
             torch.randint(0, CLASSES, (SAMPLES,), generator=generator)) for _ in range(STEPS)]
    return made, data


@pytest.mark.parametrize("batch_norm", [True, False], ids=["batch-norm", "linear-only"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_stacked_steps_equal_autograd_steps_of_each_head(kind, batch_norm):
    heads, data = heads_and_data(batch_norm)
    alone = copy.deepcopy(heads)
    stacked = StackedHeads(heads, kind, 0.05, 0.9)
    separate = [optimizer_of(kind, head) for head in alone]
    for features, labels in data:
        sums = stacked.step(torch.cat(features, dim=1), labels, onehot(labels), scored=(1, 7))
        for index, (head, optimizer, head_features) in enumerate(zip(alone, separate, features)):
            optimizer.zero_grad()
            logits = head(head_features)
            if index == 1:  # the scored member: loss x 7 and correct over its first 7 samples, before the step
                losses = F.cross_entropy(logits[:7], labels[:7], reduction="none")
                expected = [losses.sum().item(), (logits[:7].argmax(1) == labels[:7]).sum().item(), 7.0]
                assert sums.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
            F.cross_entropy(logits, labels).backward()
            optimizer.step()
    for a, b in zip(heads, alone):  # the stacked heads' own modules are views of the stack
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.allclose(x.double(), y.double(), rtol=1e-5, atol=1e-6), name
    for member, reference in enumerate(separate):  # each head's optimiser state, in a separate optimiser's layout
        mine, theirs = stacked.member_optimizer_state(member), reference.state_dict()
        assert sorted(mine["state"]) == sorted(theirs["state"]) == [0, 1]
        assert mine["param_groups"] == theirs["param_groups"]
        for index in mine["state"]:
            for name, value in theirs["state"][index].items():
                assert torch.allclose(torch.as_tensor(mine["state"][index][name]).double(),
                                      torch.as_tensor(value).double(), rtol=1e-5, atol=1e-7), name


def test_member_states_loaded_into_a_new_stack_go_on_as_before():
    heads, data = heads_and_data(batch_norm=True)
    stacked = StackedHeads(heads, "adamw", 0.05, 0.9)
    stacked.step(torch.cat(data[0][0], dim=1), data[0][1], onehot(data[0][1]))
    saved = [(copy.deepcopy(h.state_dict()), stacked.member_optimizer_state(i)) for i, h in enumerate(heads)]
    stacked.step(torch.cat(data[1][0], dim=1), data[1][1], onehot(data[1][1]))
    after_two = [copy.deepcopy(h.state_dict()) for h in heads]

    fresh, _ = heads_and_data(batch_norm=True)
    for head in fresh:  # other starting values, overwritten by the loaded state
        head.linear.weight.data.mul_(3)
    resumed = StackedHeads(fresh, "adamw", 0.05, 0.9)
    for i, (head_state, optimizer_state) in enumerate(saved):
        fresh[i].load_state_dict(head_state)
        resumed.load_member_optimizer_state(i, optimizer_state)
    resumed.step(torch.cat(data[1][0], dim=1), data[1][1], onehot(data[1][1]))
    for head, expected in zip(fresh, after_two):
        for name, value in expected.items():
            assert torch.equal(head.state_dict()[name], value), name


def test_a_step_dispatches_the_same_operations_for_one_head_and_for_twelve():
    counts = []
    for size in (1, 12):
        heads, data = heads_and_data(batch_norm=True, heads=size)
        stacked = StackedHeads(heads, "adamw", 0.05, 0.9)
        features, labels = torch.cat(data[0][0], dim=1), data[0][1]
        target = onehot(labels)
        stacked.step(features, labels, target)  # the optimiser's state is made at the first step
        with OpCounter() as counter:
            stacked.step(features, labels, target)
        counts.append(sum(counter.ops.values()))
    assert counts[0] == counts[1] <= 30, counts
