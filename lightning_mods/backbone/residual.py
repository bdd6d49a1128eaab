"""The residual sum every shortcut-aware block shares (the decay paper, section 3.1).

A block with sub-layers ``j = 0, 1, ...`` computes each of them as
``a_j * shortcut + b_j * branch`` through :meth:`DecayedResidual.residual`. The weights come
from a :class:`~lightning_mods.backbone.shortcut.ShortcutSchedule` applied to the whole network in
depth order by :func:`apply_shortcut_schedule`, so a block never needs to know its depth.

The optional ``branch_hook`` sees each branch output before the sum; the ResidualDroppath
callback uses it to mask branches without the model knowing.

Checkpoints describe themselves: every block writes its resolved weights as the float64
``N x 2`` tensor ``<block>.shortcut_weights`` (rows ``(a_j, b_j)``; for a learnable ``a_j`` the
initial value, the trained one is the ``alpha_*`` parameter) into its ``state_dict``, and
``load_state_dict`` sets them back, so a state_dict alone rebuilds the network that wrote it.
The forward keeps Python floats (the bit-exact ``a == 1`` path costs nothing). Policy:

- entries present: the loaded weights win; if they differ from the schedule the network was
  built with, the network that owns the schedule warns once, in one line, naming the first
  differing sub-layer and both values;
- entries absent (a stock timm state_dict): accepted only for a block whose weights are all
  ``(1, 1)`` (the standard network); a decayed block reports its entry as missing, so a strict
  load fails naming it. :func:`timm_state_dict` strips the entries for export to timm.
"""
from __future__ import annotations

from typing import Callable, Optional

import warnings

import torch
from torch import nn

from .shortcut import ShortcutSchedule, SubLayerType

BranchHook = Callable[["DecayedResidual", int, torch.Tensor], torch.Tensor]

SHORTCUT_KEY = "shortcut_weights"


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

    def residual(self, j: int, shortcut: torch.Tensor, branch: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """Sub-layer ``j``: ``a_j * shortcut + b_j * branch``.

        ``inplace``: the sum may be written into ``branch``, as timm's ResNet blocks do
        (``x += shortcut``), saving an activation-sized allocation; only where nothing else
        holds the branch (no ``branch_hook``) and the sum keeps its dtype (under autocast a
        bf16 branch plus a float32 shortcut is float32, out of place).
        """
        if self.branch_hook is not None:
            branch, inplace = self.branch_hook(self, j, branch), False
        return weighted_sum(shortcut, branch, self.shortcut_weight(j), self._fixed_weights[j][1], inplace)

    def is_standard(self) -> bool:
        """Whether every sub-layer is the plain ``x + f(x)`` (fixed ``a = b = 1``)."""
        return not any(self._learnable) and all(w == (1.0, 1.0) for w in self._fixed_weights)

    def _save_to_state_dict(self, destination, prefix: str, keep_vars: bool) -> None:  # noqa: ANN001
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # not a registered buffer: float64 whatever .to()/.half() does, never broadcast by DDP
        destination[prefix + SHORTCUT_KEY] = torch.tensor(self._fixed_weights, dtype=torch.float64)

    def _load_from_state_dict(self, state_dict, prefix: str, local_metadata, strict: bool,  # noqa: ANN001
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + SHORTCUT_KEY
        if key not in state_dict:
            if not self.is_standard():
                missing_keys.append(key)
            return
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        value = state_dict[key]
        n = len(self.sublayer_types)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (n, 2):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            error_msgs.append(f"size mismatch for {key}: copying {shape}, the block has {n} sub-layers "
                              f"so it expects ({n}, 2) rows (a, b)")
            return
        self._fixed_weights = [(float(a), float(b)) for a, b in value.double().tolist()]

    def shortcut_extra_repr(self) -> str:
        parts = []
        for j, name in enumerate(self.alpha_names):
            a = self.shortcut_weight(j)
            a = float(a.detach()) if isinstance(a, torch.Tensor) else a
            b = self._fixed_weights[j][1]
            parts.append(f"{name}={a:.4g}" + ("" if b == 1.0 else f" (branch x{b:.4g})"))
        return ", ".join(parts)


def weighted_sum(shortcut: torch.Tensor, branch: torch.Tensor, a: torch.Tensor | float, b: float,
                 inplace: bool) -> torch.Tensor:
    """``a * shortcut + b * branch`` in one elementwise kernel, in place into ``branch`` when
    ``inplace`` and the sum keeps the branch's dtype and shape (:meth:`DecayedResidual.residual`).

    A leaf of FX graphs (``torch.fx.wrap``): the in-place choice reads the tensors' dtypes and
    shapes, which symbolic tracing cannot branch on, so a traced network calls this function
    whole and computes exactly what the eager one does.
    """
    if b != 1.0:
        branch, inplace = branch * b, True  # a new tensor, ours
    inplace = inplace and torch.result_type(branch, shortcut) == branch.dtype and branch.shape == shortcut.shape
    if isinstance(a, float):
        if a == 1.0:  # bit-identical to the standard residual network (either order, either place)
            return branch.add_(shortcut) if inplace else shortcut + branch
        # one elementwise kernel, not a product then a sum (rounding may differ in the last bit)
        return branch.add_(shortcut, alpha=a) if inplace else torch.add(branch, shortcut, alpha=a)
    # a learnable alpha: still one kernel
    return branch.addcmul_(a, shortcut) if inplace else torch.addcmul(branch, a, shortcut)


torch.fx.wrap("weighted_sum")


def residual_blocks(model: nn.Module) -> list[DecayedResidual]:
    """All shortcut-aware blocks of ``model`` in registration (= depth) order."""
    return [m for m in model.modules() if isinstance(m, DecayedResidual)]


def schedule_weights(model: nn.Module, schedule: ShortcutSchedule) -> list[tuple[float, float]]:
    """``(a_k, b_k)`` that ``schedule`` gives the sub-layers of ``model``, in depth order."""
    types: list[SubLayerType] = [t for blk in residual_blocks(model) for t in blk.sublayer_types]
    return schedule.weights(len(types), types)


def apply_shortcut_schedule(model: nn.Module, schedule: ShortcutSchedule | None) -> int:
    """Give every residual sub-layer of ``model`` its weights, in depth order.

    Returns ``K``, the number of residual sub-layers. ``None`` means the standard network.
    ``model`` then warns when a ``load_state_dict`` brings other weights (module docstring).
    """
    schedule = schedule if schedule is not None else ShortcutSchedule("none")
    blocks = residual_blocks(model)
    if not blocks:
        raise ValueError(f"model has no shortcut-aware residual blocks: {type(model).__name__}")
    weights = schedule_weights(model, schedule)
    k = 0
    for blk in blocks:
        n = len(blk.sublayer_types)
        learnable = [schedule.learnable and schedule.decays(t) for t in blk.sublayer_types]
        blk.set_shortcut_weights(weights[k:k + n], learnable)
        k += n
    model._built_shortcut = schedule
    if not getattr(model, "_warns_on_other_shortcut", False):
        model.register_load_state_dict_post_hook(_warn_on_other_shortcut)
        model._warns_on_other_shortcut = True
    return k


def _warn_on_other_shortcut(model: nn.Module, incompatible_keys) -> None:  # noqa: ANN001
    """Post-load hook of a schedule's owner: one line when the loaded weights are not its schedule's."""
    schedule = model._built_shortcut
    loaded = [w for blk in residual_blocks(model) for w in blk._fixed_weights]
    built = schedule_weights(model, schedule)
    if loaded == built:
        return
    k = next(i for i, (u, v) in enumerate(zip(loaded, built)) if u != v)
    differ = sum(u != v for u, v in zip(loaded, built))
    warnings.warn(
        f"{type(model).__name__}.load_state_dict: the state_dict's shortcut weights are not those of {schedule}: "
        f"sub-layer {k} has (a, b) = {loaded[k][0]:.6g}, {loaded[k][1]:.6g} there and {built[k][0]:.6g}, "
        f"{built[k][1]:.6g} here ({differ} of {len(built)} differ); the loaded weights are used",
        stacklevel=2)


def timm_state_dict(model: nn.Module, force: bool = False) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the ``shortcut_weights`` entries: loadable into timm's own
    ``VisionTransformer``/``ResNet`` with ``strict=True``.

    Refuses (ValueError) a network that is not the standard one (some ``a`` or ``b`` not 1, or
    learnable shortcuts), whose weights timm could not represent; ``force=True`` exports anyway.
    """
    if not force:
        for name, blk in model.named_modules():
            if isinstance(blk, DecayedResidual) and not blk.is_standard():
                raise ValueError(f"timm_state_dict: {name or type(model).__name__} has decayed or learnable "
                                 f"shortcuts ({blk.shortcut_extra_repr()}); timm's blocks compute x + f(x), so "
                                 "its weights would give another network; pass force=True to export anyway")
    return {k: v for k, v in model.state_dict().items()
            if not (k == SHORTCUT_KEY or k.endswith("." + SHORTCUT_KEY))}


def shortcut_alphas(model: nn.Module) -> list[float]:
    """The current shortcut weight of every sub-layer in depth order (learned ones included)."""
    out = []
    for blk in residual_blocks(model):
        for j in range(len(blk.sublayer_types)):
            a = blk.shortcut_weight(j)
            out.append(float(a.detach()) if isinstance(a, torch.Tensor) else a)
    return out
