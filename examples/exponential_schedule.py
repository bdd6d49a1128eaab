"""A shortcut schedule of one's own: exponential decay, ``a_k = max(alpha_min, exp(-rate * k))``
for decayed sub-layer ``k`` (``docs``: extending shortcutlab, "A new schedule").

A schedule is a :class:`ShortcutSchedule` subclass that overrides ``decayed_alpha`` and keeps
each ``__init__`` argument as an attribute of the same name; its class path and arguments are
saved in the checkpoint, which rebuilds this schedule (and so the same network) by itself.
With this file's folder on ``PYTHONPATH``, any family takes it from YAML or the command line::

    shortcutlab fit --config configs/digits_mae.yaml \\
        --model.network.shortcut=exponential_schedule.ExponentialSchedule --model.network.shortcut.rate=0.05

    # the ResNet classifier (its data config first): model.init_args.network.init_args.shortcut
    # in YAML, or
    shortcutlab fit --config configs/data/digits.yaml --config configs/digits_resnet/base.yaml \\
        --model.network.shortcut=exponential_schedule.ExponentialSchedule
"""
from __future__ import annotations

import math

from lightning_mods.backbone import ShortcutSchedule


class ExponentialSchedule(ShortcutSchedule):
    """``a_k = max(alpha_min, exp(-rate * k))``; ``branches`` as the built-in schedules."""

    def __init__(self, rate: float = 0.05, alpha_min: float = 0.0, branches: str = "both") -> None:
        super().__init__(kind="linear", alpha_min=alpha_min, branches=branches)  # "linear": alpha_min is solvable
        if not math.isfinite(rate) or rate < 0:
            raise ValueError(f"rate must be a finite number >= 0, got {rate!r}")
        self.rate = float(rate)

    def decayed_alpha(self, k: int, num_sublayers: int) -> float:
        return max(self.alpha_min, math.exp(-self.rate * k))
