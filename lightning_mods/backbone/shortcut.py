"""The decayed identity shortcut schedule (the decay paper, section 3.1; "Residual Connections Harm
Generative Representation Learning", section 3).

A residual sub-layer normally computes ``x <- x + f(x)``. Here every sub-layer ``k`` of a
network with ``K`` sub-layers computes ``x <- a_k * x + b_k * f(x)``:

=================  ==========================================  =========
kind               shortcut weight ``a_k``                      ``b_k``
=================  ==========================================  =========
``none``           1 (the standard residual network)            1
``linear``         ``1 - k / (K - 1) * (1 - alpha_min)``        1
``cosine``         ``alpha_min + (1 - alpha_min) * (1 + cos(pi k / (K-1))) / 2``  1
``constant``       ``alpha_min``                                1
``learnable``      a trainable scalar, initialised at 1         1
``scaled_branch``  1                                            ``scale``
``scaled_sum``     ``scale``                                    ``scale``
=================  ==========================================  =========

``scaled_branch`` is the ablation ``x + c f(x)`` and ``scaled_sum`` is ``c (x + f(x))``
(``c = sqrt(1/2)`` in the paper). In a transformer block the attention and the MLP
sub-layers are counted separately (``K = 2 * depth``); ``branches`` picks which of them are
decayed, the others keep ``a_k = b_k = 1``. The linear schedule follows the authors' code:
exactly ``alpha_min`` at the last sub-layer.

A schedule of one's own is a subclass that overrides :meth:`ShortcutSchedule.decayed_alpha`
(``a_k`` of decayed sub-layer ``k`` of ``K``), usable from YAML by ``class_path`` in every family.
Its class path and arguments are saved in checkpoints (:meth:`ShortcutSchedule.as_dict`) and a
checkpoint rebuilds that class, with those arguments, or says in one line why it cannot.
"""
from __future__ import annotations

import inspect
import math
from typing import Any, Literal

from ._imports import import_path

Kind = Literal["none", "linear", "cosine", "constant", "learnable", "scaled_branch", "scaled_sum"]
Branches = Literal["both", "attn", "mlp"]
SubLayerType = Literal["attn", "mlp", "block"]

KINDS: tuple[str, ...] = ("none", "linear", "cosine", "constant", "learnable", "scaled_branch", "scaled_sum")
BRANCHES: tuple[str, ...] = ("both", "attn", "mlp")
_SOLVABLE: tuple[str, ...] = ("linear", "cosine", "constant")


def _check_unit_interval(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a finite number in [0, 1], got {value!r}")
    return value


def check_depth(value: int, name: str = "num_sublayers", what: str = "") -> int:
    """``value`` as a positive integer, or a one-line ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer{what}, got {value!r}")
    return value


def check_heads(width: int, heads: int, width_name: str = "embed_dim", heads_name: str = "num_heads") -> None:
    """A one-line ValueError naming both settings when ``heads`` attention heads cannot split ``width``."""
    check_depth(heads, heads_name)
    if width % heads:
        raise ValueError(f"{heads_name} ({heads}) must divide {width_name} ({width}): each head takes "
                         f"{width_name} / {heads_name} channels")


class ShortcutSchedule:
    """Describes how the identity shortcut of every residual sub-layer is weighted.

    Extension point: a subclass overrides :meth:`decayed_alpha`. It may take arguments of its
    own: plain data (numbers, strings), each kept as an attribute of the same name, as the
    built-in ones are, since :meth:`as_dict` reads them back for the checkpoint.

    Args:
        kind: one of ``none``, ``linear`` (default), ``cosine``, ``constant``, ``learnable``,
            ``scaled_branch``, ``scaled_sum`` (see the module docstring).
        alpha_min: the shortcut weight reached at the last sub-layer (linear, cosine) or
            used everywhere (constant). 1.0 gives the standard network.
        branches: which transformer sub-layers decay: ``both``, ``attn`` or ``mlp``.
            ResNet blocks (sub-layer type ``block``) always follow the schedule.
        scale: the constant ``c`` of the two scaling variants.
    """

    def __init__(
        self,
        kind: Kind = "linear",
        alpha_min: float = 0.6,
        branches: Branches = "both",
        scale: float = math.sqrt(0.5),
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
        if branches not in BRANCHES:
            raise ValueError(f"branches must be one of {', '.join(BRANCHES)}; got {branches!r}")
        self.kind = kind
        self.alpha_min = _check_unit_interval("alpha_min", alpha_min)
        self.branches = branches
        self.scale = _check_unit_interval("scale", scale)

    def schedule_class(self) -> type["ShortcutSchedule"]:
        """The schedule's class (jsonargparse's lazy default instance stands for its base)."""
        return next(c for c in type(self).__mro__
                    if issubclass(c, ShortcutSchedule) and not c.__name__.startswith("LazyInstance_"))

    def init_args(self) -> dict[str, Any]:
        """The arguments that rebuild this schedule: its class's ``__init__`` parameters, read
        back from the attributes of the same names."""
        names = [n for n, p in inspect.signature(self.schedule_class().__init__).parameters.items()
                 if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        missing = [n for n in names if not hasattr(self, n)]
        if missing:
            raise ValueError(f"{self.schedule_class().__name__}: keep each __init__ argument as an attribute of the "
                             f"same name (missing: {', '.join(missing)}); a checkpoint rebuilds the schedule from them")
        return {n: getattr(self, n) for n in names}

    def __repr__(self) -> str:
        return f"{self.schedule_class().__name__}({', '.join(f'{k}={v!r}' for k, v in self.init_args().items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShortcutSchedule) and self.as_dict() == other.as_dict()

    def as_dict(self) -> dict:
        """Plain-data form, safe in checkpoints loaded with ``weights_only=True``: the built-in
        schedule as its four fields, a subclass as ``{"class_path", "init_args"}``."""
        cls = self.schedule_class()
        if cls is ShortcutSchedule:
            return self.init_args()
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": self.init_args()}

    @classmethod
    def coerce(cls, value: "ShortcutSchedule | dict | None", default: "ShortcutSchedule | None" = None
               ) -> "ShortcutSchedule":
        """Accept a schedule, its :meth:`as_dict` form (from a checkpoint), LightningCLI's
        ``class_path``/``init_args`` form or ``None`` (-> ``default``)."""
        if value is None:
            return default if default is not None else cls("none")
        if isinstance(value, ShortcutSchedule):
            return value
        if isinstance(value, dict):
            schedule_class = schedule_class_at(value["class_path"]) if "class_path" in value else cls
            args = value.get("init_args", value) if "class_path" in value else value
            return schedule_class(**{k: v for k, v in (args or {}).items() if k != "class_path"})
        raise ValueError(f"shortcut must be a ShortcutSchedule or a dict of its fields, got {type(value).__name__}")

    @property
    def learnable(self) -> bool:
        return self.kind == "learnable"

    def decays(self, sublayer_type: SubLayerType) -> bool:
        """Whether a sub-layer of this type follows the schedule (``block`` always does)."""
        return sublayer_type == "block" or self.branches in ("both", sublayer_type)

    def decayed_alpha(self, k: int, num_sublayers: int) -> float:
        """``a_k``, the shortcut weight of decayed sub-layer ``k`` (0-based) of ``num_sublayers``:
        the method a schedule of one's own overrides (a learnable schedule's initial value)."""
        if self.kind in ("none", "learnable", "scaled_branch"):
            return 1.0
        if self.kind in ("constant",):
            return self.alpha_min
        if self.kind == "scaled_sum":
            return self.scale
        if num_sublayers == 1:
            return 1.0
        t = k / (num_sublayers - 1)
        if self.kind == "linear":
            # written as 1 - t*(1 - a) so that t = 1 gives exactly alpha_min in float64
            return self.alpha_min if k == num_sublayers - 1 else 1.0 - t * (1.0 - self.alpha_min)
        # cosine: 1 at the first sub-layer, alpha_min at the last
        return self.alpha_min + (1.0 - self.alpha_min) * 0.5 * (1.0 + math.cos(math.pi * t))

    def weights(
        self, num_sublayers: int, sublayer_types: list[SubLayerType] | None = None
    ) -> list[tuple[float, float]]:
        """``(shortcut weight a_k, branch weight b_k)`` for every sub-layer ``k``.

        ``sublayer_types[k]`` says whether sub-layer ``k`` is an ``attn``, ``mlp`` or ResNet
        ``block``; sub-layers whose type is not decayed get ``(1, 1)``.
        """
        check_depth(num_sublayers)
        if sublayer_types is None:
            if self.branches != "both":
                raise ValueError(f"sublayer_types: with branches={self.branches!r} only some sub-layers decay; pass "
                                 "their types, e.g. transformer_sublayer_types(depth) for a ViT")
            sublayer_types = ["block"] * num_sublayers
        if len(sublayer_types) != num_sublayers:
            raise ValueError(f"sublayer_types has {len(sublayer_types)} entries for {num_sublayers} sub-layers")
        branch_weight = self.scale if self.kind in ("scaled_branch", "scaled_sum") else 1.0
        out = []
        for k, sublayer_type in enumerate(sublayer_types):
            if self.decays(sublayer_type):
                out.append((self.decayed_alpha(k, num_sublayers), branch_weight))
            else:
                out.append((1.0, 1.0))
        return out

    def alphas(self, num_sublayers: int, sublayer_types: list[SubLayerType] | None = None) -> list[float]:
        """Shortcut weights ``alpha_k`` (initial values for ``learnable``)."""
        return [a for a, _ in self.weights(num_sublayers, sublayer_types)]

    def alpha_eff(self, num_sublayers: int, sublayer_types: list[SubLayerType] | None = None) -> float:
        """Effective decay ``prod_k alpha_k`` (the paper's best results: in [1e-3, 1e-2))."""
        return math.prod(self.alphas(num_sublayers, sublayer_types))

    def solve_alpha_min(
        self,
        target_alpha_eff: float,
        num_sublayers: int,
        sublayer_types: list[SubLayerType] | None = None,
    ) -> float:
        """The ``alpha_min`` for which this kind of schedule reaches ``target_alpha_eff``.

        ``alpha_eff`` grows monotonically with ``alpha_min`` for the linear, cosine and
        constant kinds, so bisection in float64 finds it to ~1e-15.
        """
        args, schedule_class = self.init_args(), self.schedule_class()
        if "alpha_min" not in args:
            raise ValueError(f"{schedule_class.__name__} takes no alpha_min to solve for")
        if self.kind not in _SOLVABLE:
            raise ValueError(
                f"kind must be one of {', '.join(_SOLVABLE)} to solve for alpha_eff; "
                f"a {self.kind!r} schedule has no alpha_min to solve for")
        check_depth(num_sublayers)
        target = float(target_alpha_eff)
        if not math.isfinite(target) or not 0.0 < target <= 1.0:
            raise ValueError(f"target_alpha_eff must be a finite number in (0, 1], got {target_alpha_eff!r}")

        def eff(alpha_min: float) -> float:
            return schedule_class(**{**args, "alpha_min": alpha_min}).alpha_eff(
                num_sublayers, sublayer_types)

        if eff(0.0) >= target:  # reached even with alpha_min = 0 (e.g. a single sub-layer)
            return 0.0
        lo, hi = 0.0, 1.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if eff(mid) < target:
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-16:
                break
        return hi


def transformer_sublayer_types(num_blocks: int) -> list[SubLayerType]:
    """``[attn, mlp, attn, mlp, ...]`` for ``num_blocks`` pre-norm transformer blocks."""
    return ["attn", "mlp"] * num_blocks


def schedule_class_at(class_path: str) -> type[ShortcutSchedule]:
    """The :class:`ShortcutSchedule` subclass a checkpoint or config names, or a one-line
    ValueError: never the built-in schedule in its place (that would be another network)."""
    try:
        found = import_path(class_path)
    except ImportError as err:
        raise ValueError(f"shortcut: cannot import {class_path!r}, the schedule the checkpoint was written with "
                         f"({err}); put its module on PYTHONPATH") from None
    except (AttributeError, ValueError):
        found = None
    if not (isinstance(found, type) and issubclass(found, ShortcutSchedule)):
        raise ValueError(f"shortcut: {class_path!r} is not a ShortcutSchedule class")
    return found

