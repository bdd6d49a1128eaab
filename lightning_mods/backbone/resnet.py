"""ResNets with decayed identity shortcuts (the decay paper, appendix B.2).

Every residual block is one sub-layer: ``out = act(a_k * shortcut(x) + b_k * f(x))``, with
``k`` counted over all blocks in depth order, projection (downsample) shortcuts included.
The blocks subclass timm's ``BasicBlock`` and ``Bottleneck`` and the networks subclass timm's
``ResNet``, so state_dict keys are timm's. Zero-init of the last branch layer is timm's
``zero_init_last`` (the last BatchNorm's weight).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn
from timm.models.resnet import BasicBlock, Bottleneck, ResNet

from ._imports import import_path
from .residual import DecayedResidual, apply_shortcut_schedule
from .shortcut import ShortcutSchedule


class DecayedResNetBlock(DecayedResidual):
    """What the decayed blocks add to timm's ``BasicBlock`` and ``Bottleneck`` (listed after this
    mixin): ``act(a * shortcut(x) + b * branch(x))`` in place of timm's ``act(shortcut(x) + f(x))``.
    A subclass gives :meth:`branch` (timm's layers up to the last norm) and :attr:`final_act`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reset_shortcut()

    @property
    def final_act(self) -> nn.Module:
        raise NotImplementedError

    def branch_end(self, x: torch.Tensor) -> torch.Tensor:
        """timm's end of every ResNet branch: squeeze-excitation, then drop path (each where set)."""
        if self.se is not None:
            x = self.se(x)
        if self.drop_path is not None:
            x = self.drop_path(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.final_act(self.residual(0, shortcut, self.branch(x), inplace=True))  # timm: x += shortcut

    def extra_repr(self) -> str:
        return self.shortcut_extra_repr()


class DecayedBasicBlock(DecayedResNetBlock, BasicBlock):
    """timm ``BasicBlock`` with a weighted shortcut."""

    @property
    def final_act(self) -> nn.Module:
        return self.act2

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.drop_block(self.bn1(self.conv1(x))))
        return self.branch_end(self.bn2(self.conv2(self.aa(x))))


class DecayedBottleneck(DecayedResNetBlock, Bottleneck):
    """timm ``Bottleneck`` with a weighted shortcut."""

    @property
    def final_act(self) -> nn.Module:
        return self.act3

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.aa(self.act2(self.drop_block(self.bn2(self.conv2(x)))))
        return self.branch_end(self.bn3(self.conv3(x)))


_DECAYED = {BasicBlock: DecayedBasicBlock, Bottleneck: DecayedBottleneck}


def cifar_stem_(model: ResNet, in_chans: int) -> ResNet:
    """Make the stem keep 32x32 resolution: a 3x3 stride-1 first convolution, no max-pool
    (``feature_info``'s reductions follow: 1, 1, 2, 4, 8).

    A plain stem's 7x7/2 convolution is replaced; a deep stem (ResNet-D) keeps its three 3x3
    convolutions with the first one's stride set to 1.
    """
    if isinstance(model.conv1, nn.Sequential):
        first = model.conv1[0]
        first.stride = (1, 1)
    else:
        out_chs = model.conv1.out_channels
        old = model.conv1.weight  # the new one where the old one is (timm's device=, dtype=)
        model.conv1 = nn.Conv2d(in_chans, out_chs, kernel_size=3, stride=1, padding=1, bias=False,
                                device=old.device, dtype=old.dtype)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    # the stem no longer halves the input twice: every feature map is 4x what timm's stem leaves
    for info in model.feature_info:
        info["reduction"] = max(1, info["reduction"] // 4)
    return model


def resolve_layer(value: Any) -> Any:
    """A dotted class path (``"torch.nn.ReLU"``, as LightningCLI writes a class default into a
    saved config) becomes the class; timm names (``"relu"``) and classes pass through."""
    if isinstance(value, str) and "." in value:
        try:
            return import_path(value)
        except (ImportError, AttributeError):
            raise ValueError(f"layer class path {value!r} cannot be imported") from None
    return value


class DecayedResNet(ResNet):
    """timm ``ResNet`` whose blocks follow a :class:`ShortcutSchedule`.

    Args:
        block: ``BasicBlock``/``Bottleneck`` (replaced by their decayed subclasses) or a
            decayed block class.
        layers: blocks per stage, e.g. ``(2, 2, 2, 2)``.
        shortcut: schedule over all blocks in depth order; ``None`` = standard network.
        zero_init_branches: zero the last BatchNorm weight of every branch (timm's
            ``zero_init_last``).
        cifar_stem: 3x3 stride-1 stem without max-pool, for 32x32 images.
        **kwargs: any ``timm.models.resnet.ResNet`` argument (``drop_path_rate`` for the
            stochastic-depth baseline, ``in_chans``, ``num_classes``, ...).
    """

    def __init__(self, block: type = BasicBlock, layers: Sequence[int] = (2, 2, 2, 2),
                 shortcut: Optional[ShortcutSchedule] = None, zero_init_branches: bool = True,
                 cifar_stem: bool = False, **kwargs: Any) -> None:
        block = _DECAYED.get(block, block)
        if not (isinstance(block, type) and issubclass(block, DecayedResidual)):
            raise ValueError(f"block must be BasicBlock, Bottleneck or a DecayedResidual block, got {block!r}")
        if len(layers) != 4 or any(int(n) <= 0 for n in layers):
            raise ValueError(f"layers must be four positive block counts, got {tuple(layers)!r}")
        for key in ("act_layer", "norm_layer", "aa_layer"):
            if key in kwargs:
                kwargs[key] = resolve_layer(kwargs[key])
        # LightningCLI resolves **kwargs against timm's signature and so passes timm's own
        # ``zero_init_last`` too; either flag set to False turns the zero-init off.
        zero_init_last = bool(kwargs.pop("zero_init_last", True))
        zero_init = bool(zero_init_branches) and zero_init_last
        super().__init__(block=block, layers=tuple(int(n) for n in layers),
                         zero_init_last=zero_init, **kwargs)
        if cifar_stem:
            cifar_stem_(self, kwargs.get("in_chans", 3))
        self.shortcut = ShortcutSchedule.coerce(shortcut)
        self.num_sublayers = apply_shortcut_schedule(self, self.shortcut)


def deeper_layers(total_blocks: int, base: Sequence[int] = (2, 2, 2, 2)) -> tuple[int, int, int, int]:
    """Stage sizes with extra blocks in the third stage (paper appendix: 8 to 16 blocks)."""
    extra = int(total_blocks) - sum(base)
    if extra < 0:
        raise ValueError(f"total_blocks must be at least {sum(base)}, got {total_blocks}")
    return (base[0], base[1], base[2] + extra, base[3])


class ResNet18Cifar(DecayedResNet):
    """CIFAR ResNet-18 (3x3 stem, no max-pool). ``num_blocks`` > 8 repeats third-stage blocks."""

    def __init__(self, num_blocks: int = 8, shortcut: Optional[ShortcutSchedule] = None,
                 zero_init_branches: bool = True, **kwargs: Any) -> None:
        super().__init__(BasicBlock, deeper_layers(num_blocks), shortcut, zero_init_branches,
                         cifar_stem=True, **kwargs)


class ResNet50(DecayedResNet):
    """ResNet-50 as timm's ``resnet50``."""

    def __init__(self, shortcut: Optional[ShortcutSchedule] = None, zero_init_branches: bool = True,
                 cifar_stem: bool = False, **kwargs: Any) -> None:
        super().__init__(Bottleneck, (3, 4, 6, 3), shortcut, zero_init_branches, cifar_stem, **kwargs)


class ResNet50d(DecayedResNet):
    """ResNet-50-D as timm's ``resnet50d`` (deep stem, average-pool downsample)."""

    def __init__(self, shortcut: Optional[ShortcutSchedule] = None, zero_init_branches: bool = True,
                 cifar_stem: bool = False, stem_width: int = 32, stem_type: str = "deep",
                 avg_down: bool = True, **kwargs: Any) -> None:
        # Named parameters, not kwargs defaults: the CLI fills every timm kwarg with timm's
        # own default (stem_width=64, stem_type="", avg_down=False), which would undo the D.
        super().__init__(Bottleneck, (3, 4, 6, 3), shortcut, zero_init_branches, cifar_stem,
                         stem_width=stem_width, stem_type=stem_type, avg_down=avg_down, **kwargs)
