"""Reference pieces written out in the tests, independently of lightning_mods."""
from __future__ import annotations

from torch import nn


def reference_cifar_stem(model: nn.Module, in_chans: int) -> nn.Module:
    """The CIFAR stem on a stock timm ResNet, independently of lightning_mods.backbone.resnet.cifar_stem_:
    a 3x3 stride-1 convolution to 64 channels and no max-pool."""
    model.conv1 = nn.Conv2d(in_chans, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model
