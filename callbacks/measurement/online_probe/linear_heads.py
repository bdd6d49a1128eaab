"""The probe's linear heads: their classes, learning rate(s) and optimiser (a piece of the online
probe).

MAE's linear probing sweeps the rate. ``lr: [0.001, 0.01]`` trains one head per rate on the same
detached features of one forward pass, each initialised as a single-rate probe would be (so each
equals that probe), and logs each under its rate: ``online_probe/val_top1@lr=0.01``. One rate
(a float) keeps the plain names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from callbacks.settings_key import format_setting
from .replay import is_whole_number

DEFAULT_LR = {"adamw": 2e-2, "sgd": 0.1}
OWNER = "OnlineLinearProbe"


@dataclass(frozen=True)
class LinearHeads:
    """What the probe's heads are: BatchNorm1d without affine (MAE's linear probe) then Linear.

    Args:
        num_classes: classes of the labels (default: the datamodule's ``num_classes``).
        lr: a rate, a list of rates (one head each), or ``None`` (:data:`DEFAULT_LR` of the optimiser).
        optimizer: ``"adamw"`` or ``"sgd"`` (with ``momentum``); weight decay 0 either way.
        batch_norm: the BatchNorm1d before the linear layer.
        seed: seed of the heads' initialisation (the same heads on every rank, no global RNG draw).
    """

    num_classes: Optional[int] = None
    lr: Union[float, list[float], None] = None
    optimizer: Literal["adamw", "sgd"] = "adamw"
    momentum: float = 0.9
    batch_norm: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_classes is not None and not is_whole_number(self.num_classes, 2):
            raise ValueError(f"{OWNER}: num_classes must be >= 2 or None, got {self.num_classes!r}")
        if self.optimizer not in DEFAULT_LR:
            raise ValueError(f"{OWNER}: optimizer must be one of {tuple(DEFAULT_LR)}, got {self.optimizer!r}")
        rates = list(self.lr) if self.several else [self.lr]
        if not rates or (self.several and None in rates) or any(
                r is not None and (isinstance(r, bool) or not r > 0) for r in rates):
            raise ValueError(f"{OWNER}: lr must be > 0, a non-empty list of rates > 0, or None, got {self.lr!r}")
        if len(set(rates)) != len(rates):
            raise ValueError(f"{OWNER}: lr lists a rate twice: {self.lr!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"{OWNER}: momentum must be in [0, 1), got {self.momentum!r}")

    @property
    def several(self) -> bool:
        """Whether ``lr`` is a list (each head's names then carry its rate)."""
        return isinstance(self.lr, (list, tuple))

    @property
    def given(self) -> Any:
        """``lr`` as the settings (and the state key) name it."""
        return [float(r) for r in self.lr] if self.several else self.lr

    @property
    def lrs(self) -> list[float]:
        """The rate of each head."""
        rates = self.lr if self.several else [self.lr]
        return [float(r) if r is not None else DEFAULT_LR[self.optimizer] for r in rates]

    def tags(self) -> list[str]:
        """Per head, the part its metric names carry: ``lr=0.01`` with several rates, else ``""``."""
        return [f"lr={format_setting(lr)}" for lr in self.lrs] if self.several else [""]
