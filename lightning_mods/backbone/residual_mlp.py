"""Residual MLP on 2-D points, the ResidualDroppath paper's feature-reuse model (the ResidualDroppath paper, section 3;
"ResidualDroppath", section 3.1).

Every hidden layer is residual and has a GELU: ``x <- a_k x + b_k GELU(W_k x + c_k)``. For the
first layer to be residual too, the 2-D input is embedded by zero-padding it to the layer
width (coordinates in nodes 0 and 1), so the input, every layer's output and the
ResidualDroppath identity path all live in the same node space; a linear head maps the last
layer to the class logits. The layers are :class:`~lightning_mods.backbone.residual.DecayedResidual`
blocks, so shortcut schedules and the ResidualDroppath callback apply unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .residual import DecayedResidual, apply_shortcut_schedule
from .shortcut import ShortcutSchedule


class ResidualMLPLayer(DecayedResidual, nn.Module):
    """One hidden layer: ``x <- a x + b GELU(fc(x))`` (one residual sub-layer)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()
        self.reset_shortcut()

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual(0, x, self.branch(x))

    def extra_repr(self) -> str:
        return self.shortcut_extra_repr()


class ResidualMLP(nn.Module):
    """``depth`` residual GELU layers of ``width`` nodes on zero-padded 2-D input, linear head.

    Args:
        depth: number of hidden (residual) layers.
        width: nodes per layer; at least ``in_features``.
        in_features: input dimensions (2 for the spiral).
        num_classes: logits of the linear head.
        shortcut: schedule over the ``depth`` layers; ``None`` = standard residual network.
    """

    def __init__(self, depth: int = 6, width: int = 6, in_features: int = 2, num_classes: int = 2,
                 shortcut: Optional[ShortcutSchedule] = None) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if in_features < 1 or width < in_features:
            raise ValueError(f"width must be >= in_features ({in_features}) so the input fits the layers, "
                             f"got width={width}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.in_features = in_features
        self.width = width
        self.num_features = width
        self.num_classes = num_classes
        self.layers = nn.ModuleList(ResidualMLPLayer(width) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)
        self.shortcut = ShortcutSchedule.coerce(shortcut)
        self.num_sublayers = apply_shortcut_schedule(self, self.shortcut)
        # every argument as plain data: what a checkpoint records to rebuild this network
        self.settings = dict(depth=depth, width=width, in_features=in_features, num_classes=num_classes,
                             shortcut=self.shortcut.as_dict())

    def reset_classifier(self, num_classes: int) -> None:
        """A new linear head of ``num_classes`` logits (timm's call)."""
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.head = nn.Linear(self.width, num_classes)
        self.num_classes = self.settings["num_classes"] = num_classes

    def embed(self, points: torch.Tensor) -> torch.Tensor:
        """``B x in_features`` -> ``B x width``: the input in nodes ``0 .. in_features-1``, zeros after."""
        if points.ndim != 2 or points.shape[1] != self.in_features:
            raise ValueError(f"points must be B x {self.in_features}, got {tuple(points.shape)}")
        return F.pad(points, (0, self.width - self.in_features))

    def forward_layers(self, points: torch.Tensor) -> list[torch.Tensor]:
        """``[embedded input, layer 1 output, ..., layer depth output]``, each ``B x width``."""
        outputs = [self.embed(points)]
        for layer in self.layers:
            outputs.append(layer(outputs[-1]))
        return outputs

    def forward_features(self, points: torch.Tensor) -> torch.Tensor:
        """Output of the last layer, ``B x width``."""
        return self.forward_layers(points)[-1]

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(points))
