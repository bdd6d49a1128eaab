"""The residual sum every shortcut-aware block shares (SPEC section 1).

A block with sub-layers ``j = 0, 1, ...`` computes each of them as
``a_j * shortcut + b_j * branch`` through :meth:`DecayedResidual.residual`. The weights come
from a :class:`~lightning_mods.shortcut.ShortcutSchedule` applied to the whole network in
depth order by :func:`apply_shortcut_schedule`, so a block never needs to know its depth.

The optional ``branch_hook`` sees each branch output before the sum; the ResidualDroppath
callback uses it to mask branches without the model knowing.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .shortcut import ShortcutSchedule, SubLayerType

BranchHook = Callable[["DecayedResidual", int, torch.Tensor], torch.Tensor]


class DecayedResidual:
    """Mixin for an ``nn.Module`` residual block; call :meth:`reset_shortcut` in ``__init__``.

    Subclasses set ``sublayer_types`` (``("attn", "mlp")`` for a transformer block,
    ``("block",)`` for a ResNet block) and ``alpha_names`` (the attribute names used for
    learnable alphas, one per sub-layer).
    """

    sublayer_types: tuple[SubLayerType, ...] = ("block",)
    alpha_names: tuple[str, ...] = ("alpha",)

    def reset_shortcut(self) -> None:
        self._fixed_weights: list[tuple[float, float]] = [(1.0, 1.0)] * len(self.sublayer_types)
        self._learnable: list[bool] = [False] * len(self.sublayer_types)
        self.branch_hook: Optional[BranchHook] = None

    def set_shortcut_weights(self, weights: list[tuple[float, float]], learnable: list[bool]) -> None:
        """Set ``(a_j, b_j)`` per sub-layer; a learnable ``a_j`` becomes a scalar parameter."""
        assert len(weights) == len(self.sublayer_types) == len(learnable)
        for name, (a, _), is_learnable in zip(self.alpha_names, weights, learnable):
            if name in self._parameters:
                del self._parameters[name]
            if is_learnable:
                ref = next(iter(self.parameters()), None)
                kw = {} if ref is None else {"device": ref.device, "dtype": ref.dtype}
                self.register_parameter(name, nn.Parameter(torch.tensor(float(a), **kw)))
        self._fixed_weights = [(float(a), float(b)) for a, b in weights]
        self._learnable = list(learnable)

    def shortcut_weight(self, j: int) -> torch.Tensor | float:
        """The current ``a_j``: a parameter when learnable, else a Python float."""
        return getattr(self, self.alpha_names[j]) if self._learnable[j] else self._fixed_weights[j][0]

    def residual(self, j: int, shortcut: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        """Sub-layer ``j``: ``a_j * shortcut + b_j * branch``."""
        if self.branch_hook is not None:
            branch = self.branch_hook(self, j, branch)
        a, b = self.shortcut_weight(j), self._fixed_weights[j][1]
        if b != 1.0:
            branch = branch * b
        if isinstance(a, float) and a == 1.0:
            return shortcut + branch  # bit-identical to the standard residual network
        return a * shortcut + branch

    def shortcut_extra_repr(self) -> str:
        parts = []
        for j, name in enumerate(self.alpha_names):
            a = self.shortcut_weight(j)
            a = float(a.detach()) if isinstance(a, torch.Tensor) else a
            b = self._fixed_weights[j][1]
            parts.append(f"{name}={a:.4g}" + ("" if b == 1.0 else f" (branch x{b:.4g})"))
        return ", ".join(parts)


def residual_blocks(model: nn.Module) -> list[DecayedResidual]:
    """All shortcut-aware blocks of ``model`` in registration (= depth) order."""
    return [m for m in model.modules() if isinstance(m, DecayedResidual)]


def apply_shortcut_schedule(model: nn.Module, schedule: ShortcutSchedule | None) -> int:
    """Give every residual sub-layer of ``model`` its weights, in depth order.

    Returns ``K``, the number of residual sub-layers. ``None`` means the standard network.
    """
    schedule = schedule if schedule is not None else ShortcutSchedule("none")
    blocks = residual_blocks(model)
    if not blocks:
        raise ValueError(f"model has no shortcut-aware residual blocks: {type(model).__name__}")
    types: list[SubLayerType] = [t for blk in blocks for t in blk.sublayer_types]
    weights = schedule.weights(len(types), types)
    k = 0
    for blk in blocks:
        n = len(blk.sublayer_types)
        learnable = [schedule.learnable and schedule.decays(t) for t in blk.sublayer_types]
        blk.set_shortcut_weights(weights[k:k + n], learnable)
        k += n
    return k


def shortcut_alphas(model: nn.Module) -> list[float]:
    """The current shortcut weight of every sub-layer in depth order (learned ones included)."""
    out = []
    for blk in residual_blocks(model):
        for j in range(len(blk.sublayer_types)):
            a = blk.shortcut_weight(j)
            out.append(float(a.detach()) if isinstance(a, torch.Tensor) else a)
    return out
