"""Several learning rates, one head each (a piece of the online probe).

MAE's linear probing sweeps the rate. ``lr: [0.001, 0.01]`` trains one head per rate on the same
detached features of one forward pass, each initialised as a single-rate probe would be (so each
equals that probe), and logs each under its rate: ``online_probe/val_top1@lr=0.01``. One rate
(a float) keeps the plain names.
"""
from __future__ import annotations

from typing import Any, Union

from callbacks.settings_key import format_setting

DEFAULT_LR = {"adamw": 2e-2, "sgd": 0.1}


class ProbeRates:
    """The rates a probe trains its heads at, and the tag of each head's metric names.

    Args:
        lr: a rate, a list of rates, or ``None`` (the optimiser's default, :data:`DEFAULT_LR`).
        optimizer: ``"adamw"`` or ``"sgd"``.
    """

    def __init__(self, lr: Union[float, list[float], None], optimizer: str, owner: str = "OnlineLinearProbe") -> None:
        if optimizer not in DEFAULT_LR:
            raise ValueError(f"{owner}: optimizer must be one of {tuple(DEFAULT_LR)}, got {optimizer!r}")
        several = isinstance(lr, (list, tuple))
        rates = list(lr) if several else [lr]
        if not rates or (several and None in rates) or any(
                r is not None and (isinstance(r, bool) or not r > 0) for r in rates):
            raise ValueError(f"{owner}: lr must be > 0, a non-empty list of rates > 0, or None, got {lr!r}")
        if len(set(rates)) != len(rates):
            raise ValueError(f"{owner}: lr lists a rate twice: {lr!r}")
        self.several = several
        self.given: Any = [float(r) for r in rates] if several else lr  # as the settings (and state key) name it
        self.lrs = [float(r) if r is not None else DEFAULT_LR[optimizer] for r in rates]

    def __len__(self) -> int:
        return len(self.lrs)

    def tags(self) -> list[str]:
        """Per head, the part its metric names carry: ``lr=0.01`` with several rates, else ``""``."""
        return [f"lr={format_setting(lr)}" for lr in self.lrs] if self.several else [""]
