"""The linear probe's head, one class for the offline :class:`~lightning_mods.linear_probe.LinearProbe`,
the online :class:`~callbacks.measurement.online_probe.OnlineLinearProbe` and the feature probes (the decay paper, section 4,
evaluation protocol; MAE's ``main_linprobe.py``).

MAE's protocol, which makes our probe numbers comparable with the papers': ``BatchNorm1d`` without
affine parameters and ``eps=1e-6``, then ``Linear`` with weights drawn from a truncated normal of
std 0.01 (cut at +-2, drawn by timm's inverse-CDF ``trunc_normal_``, which MAE's code calls; the
rejection sampler of recent ``torch.nn.init.trunc_normal_`` draws other values from the same seed)
and a zero bias. The features are detached inside the head, so no gradient of the probe
ever reaches the backbone. ``tests/lightning_mods/test_probe_head.py`` checks the head against one built as
``main_linprobe`` builds it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

BATCH_NORM_EPS = 1e-6
INIT_STD = 0.01


class ProbeHead(nn.Module):
    """``Linear(BatchNorm1d(features.detach(), affine=False, eps=1e-6))`` (MAE's linear probe).

    Args:
        num_features: width ``D`` of the features.
        num_classes: outputs.
        batch_norm: the BatchNorm before the linear layer (MAE's); ``False``: the linear layer alone.
        generator: draws the weights' truncated normal (``None``: the global RNG); ``nn.Linear``'s
            own initialisation, overwritten here, draws from the global RNG first, as in MAE.
    """

    def __init__(self, num_features: int, num_classes: int, batch_norm: bool = True,
                 generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(num_features, affine=False, eps=BATCH_NORM_EPS) if batch_norm else nn.Identity()
        self.linear = nn.Linear(num_features, num_classes)
        self.reset_parameters(generator)

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """MAE's probe init: weight ~ trunc_normal(std 0.01) in [-2, 2], bias 0."""
        truncated_normal_(self.linear.weight, INIT_STD, generator=generator)
        nn.init.zeros_(self.linear.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(features.detach()))


def truncated_normal_(tensor: torch.Tensor, std: float, generator: Optional[torch.Generator] = None,
                      low: float = -2.0, high: float = 2.0) -> torch.Tensor:
    """Fill ``tensor`` from N(0, std^2) cut to ``[low, high]`` by the inverse CDF of a uniform
    draw: the values of timm's ``trunc_normal_`` (MAE's) for the same RNG state, from ``generator``."""
    def cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    with torch.no_grad():
        tensor.uniform_(2 * cdf(low / std) - 1, 2 * cdf(high / std) - 1, generator=generator)
        tensor.erfinv_()
        tensor.mul_(std * math.sqrt(2.0))
        return tensor.clamp_(min=low, max=high)
