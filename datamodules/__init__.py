"""Image datamodules of shortcutlab (the decay paper, section 4, data); see docs/contracts.md."""
from datamodules.base import ImageDataModule
from datamodules.digits import Digits
from datamodules.imagenet import ImageNet
from datamodules.torchvision_sets import CIFAR10, CIFAR100, MNIST

__all__ = ["ImageDataModule", "Digits", "ImageNet", "CIFAR10", "CIFAR100", "MNIST"]
