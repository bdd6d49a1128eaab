"""The probe head is MAE's linear-probe head: built independently as
``main_linprobe.py`` builds it (timm's ``trunc_normal_`` of std 0.01 on a fresh ``nn.Linear``,
zero bias, ``BatchNorm1d(affine=False, eps=1e-6)`` in front), with the same seed it gives the
same outputs and the same first SGD steps as the head every probe of shortcutlab uses. A change
of the protocol (affine batch norm, another eps, another init std) fails here."""
from __future__ import annotations

import pytest
import torch
from timm.layers import trunc_normal_
from torch import nn

from callbacks.measurement.online_probe import LinearHeads, OnlineLinearProbe
from lightning_mods.linear_probe import LinearProbe
from lightning_mods.evaluation._probe_head import ProbeHead

D, C = 12, 5


def mae_linprobe_head(seed: int) -> nn.Sequential:
    """As facebookresearch/mae main_linprobe.py: ``model.head`` (an nn.Linear whose weight it
    re-draws with trunc_normal_(std=0.01); the model's init zeroes the bias) behind a BatchNorm."""
    torch.manual_seed(seed)
    head = nn.Linear(D, C)
    trunc_normal_(head.weight, std=0.01)
    nn.init.zeros_(head.bias)
    return nn.Sequential(nn.BatchNorm1d(D, affine=False, eps=1e-6), head)


def sgd_steps(head: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """Outputs of three SGD steps (lr 0.1, momentum 0.9, as the offline probe), then in eval mode."""
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    outputs = []
    head.train()
    for x, y in batches:
        logits = head(x)
        outputs.append(logits.detach().clone())
        optimizer.zero_grad()
        nn.functional.cross_entropy(logits, y).backward()
        optimizer.step()
    head.eval()
    outputs.append(head(batches[0][0]).detach().clone())
    return outputs


@pytest.fixture
def batches():
    g = torch.Generator().manual_seed(7)
    return [(3 * torch.randn(16, D, generator=g) + 1, torch.randint(0, C, (16,), generator=g)) for _ in range(3)]


def test_the_head_is_mae_linprobe_s_head(batches):
    reference = mae_linprobe_head(seed=0)
    torch.manual_seed(0)
    ours = ProbeHead(D, C)
    assert [n for n, _ in ours.named_parameters()] == ["linear.weight", "linear.bias"]  # no affine batch norm
    assert torch.equal(ours.linear.weight, reference[1].weight) and torch.equal(ours.linear.bias, reference[1].bias)
    for got, want in zip(sgd_steps(ours, batches), sgd_steps(reference, batches)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.norm.running_var, reference[0].running_var, rtol=1e-6, atol=0)


def test_every_probe_uses_that_head():
    """The online probe's heads and the offline probe's head are that class, seeded alike."""
    online = OnlineLinearProbe(heads=LinearHeads(num_classes=C, seed=3))
    online.build_heads(D)
    with torch.random.fork_rng(devices=[]):
        expected = ProbeHead(D, C, generator=torch.Generator().manual_seed(3))
    assert type(online.head) is ProbeHead
    assert torch.equal(online.head.linear.weight, expected.linear.weight)
    assert LinearProbe.__init__.__globals__["ProbeHead"] is ProbeHead  # the module's one head class


def test_the_check_fails_for_a_changed_protocol(batches):
    """An affine batch norm, another eps or another init std gives other numbers than MAE's head."""
    reference = sgd_steps(mae_linprobe_head(seed=0), batches)
    variants = {
        "affine": lambda h: setattr(h, "norm", nn.BatchNorm1d(D, affine=True, eps=1e-6)),
        "eps 1e-5": lambda h: setattr(h, "norm", nn.BatchNorm1d(D, affine=False, eps=1e-5)),
        "std 0.1": lambda h: nn.init.trunc_normal_(h.linear.weight, std=0.1),
    }
    for name, change in variants.items():
        torch.manual_seed(0)
        head = ProbeHead(D, C)
        change(head)
        differs = any(not torch.allclose(got, want, rtol=1e-6, atol=1e-7)
                      for got, want in zip(sgd_steps(head, batches), reference))
        assert differs, name
