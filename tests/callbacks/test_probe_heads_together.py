"""Probe heads stepped together (callbacks/_utils/probe_heads_together.py) against the same heads
stepped one by one with torch autograd: weights, batch-norm running statistics and optimiser
states after several steps, for AdamW and SGD, with and without batch norm."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from callbacks._utils.probe_heads_together import JointStep, step_heads_together
from lightning_mods.training.optim import adamw
from lightning_mods.evaluation.probe_head import ProbeHead

WIDTH, CLASSES, SAMPLES, HEADS, STEPS = 6, 4, 10, 3, 5


def optimizer_of(kind: str, head: ProbeHead) -> torch.optim.Optimizer:
    if kind == "adamw":
        return adamw(list(head.parameters()), lr=0.05, weight_decay=0.0)
    return torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9, weight_decay=0.0)


def heads_and_data(batch_norm: bool):
    generator = torch.Generator().manual_seed(0)
    heads = [ProbeHead(WIDTH, CLASSES, batch_norm, generator=generator) for _ in range(HEADS)]
    for head in heads:  # a non-zero bias, so that the bias's own gradient matters
        head.linear.bias.data.normal_(0, 0.1, generator=generator)
    data = [([torch.randn(SAMPLES, WIDTH, generator=generator) * (h + 1) + h for h in range(HEADS)],
             torch.randint(0, CLASSES, (SAMPLES,), generator=generator)) for _ in range(STEPS)]
    return heads, data


@pytest.mark.parametrize("batch_norm", [True, False], ids=["batch-norm", "linear-only"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_heads_stepped_together_equal_autograd_steps_of_each(kind, batch_norm):
    together, data = heads_and_data(batch_norm)
    alone = copy.deepcopy(together)
    joint = JointStep([optimizer_of(kind, head) for head in together])
    separate = [optimizer_of(kind, head) for head in alone]
    for features, labels in data:
        step_heads_together(together, joint, features, labels)
        for head, optimizer, head_features in zip(alone, separate, features):
            optimizer.zero_grad()
            F.cross_entropy(head(head_features), labels).backward()
            optimizer.step()
    for a, b in zip(together, alone):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.allclose(x.double(), y.double(), rtol=1e-5, atol=1e-6), name
    for optimizer, reference in zip(joint.optimizers, separate):  # the state stays each head's own
        mine, theirs = optimizer.state_dict()["state"], reference.state_dict()["state"]
        assert sorted(mine) == sorted(theirs) == [0, 1]
        for index in mine:
            for name, value in theirs[index].items():
                assert torch.allclose(torch.as_tensor(mine[index][name]).double(),
                                      torch.as_tensor(value).double(), rtol=1e-5, atol=1e-7), name


def test_a_state_loaded_into_one_optimiser_is_the_one_the_next_joint_step_uses():
    heads, data = heads_and_data(batch_norm=True)
    optimizers = [optimizer_of("adamw", head) for head in heads]
    joint = JointStep(optimizers)
    step_heads_together(heads, joint, *data[0])
    saved_head, saved_optimizer = copy.deepcopy(heads[1].state_dict()), copy.deepcopy(optimizers[1].state_dict())
    step_heads_together(heads, joint, *data[1])
    after_two = copy.deepcopy(heads[1].state_dict())
    heads[1].load_state_dict(saved_head)  # a resume of head 1 from after the first step
    optimizers[1].load_state_dict(saved_optimizer)
    step_heads_together(heads, joint, *data[1])
    for name, value in after_two.items():
        assert torch.equal(heads[1].state_dict()[name], value), name


def test_joint_step_refuses_optimisers_whose_settings_differ():
    heads, _ = heads_and_data(batch_norm=True)
    with pytest.raises(ValueError, match="settings differ"):
        JointStep([adamw(list(heads[0].parameters()), lr=0.05, weight_decay=0.0),
                   adamw(list(heads[1].parameters()), lr=0.01, weight_decay=0.0)])
    with pytest.raises(ValueError, match="one class"):
        JointStep([adamw(list(heads[0].parameters()), lr=0.05, weight_decay=0.0),
                   torch.optim.SGD(heads[1].parameters(), lr=0.05)])
