"""scikit-learn's bundled handwritten digits, the quickstart's embedded data (the decay paper, section 4, data).

1797 grey 8x8 images with values 0..16, 10 classes, shipped inside scikit-learn: no download.
Fixed stratified split (``train_test_split(test_size=0.2, stratify=labels, random_state=0)``):
1437 train and 360 held-out images, every class in both splits in proportion (139..146 train,
35..37 held out per class).

Documented transform: ``x / 16`` -> bilinear resize of the 8x8 image to ``image_size``
(``align_corners=False``, antialiased when shrinking) -> ``(x - mean) / std`` with the train
split's pixel statistics. It is done once for the whole array in ``setup``; the train
augmentation then crops the ready normalised tensors (normalising commutes with the crop's
interpolation, whose weights sum to one), so an item costs one small crop.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset
from torchvision.transforms import InterpolationMode, v2

from datamodules.base import ImageDataModule, InMemoryImages

DIGITS_MAX_VALUE = 16.0
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0
# Pixel mean and standard deviation of the train split after x / 16.
DIGITS_MEAN = (0.3054,)
DIGITS_STD = (0.3761,)


def digits_split_indices(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fixed stratified (train, held-out) indices into the 1797 digits with ``labels``."""
    return train_test_split(np.arange(len(labels)), test_size=DIGITS_TEST_FRACTION, stratify=labels,
                            random_state=DIGITS_SPLIT_SEED)


def digits_to_tensor(raw: np.ndarray, image_size: int, mean: float, std: float) -> torch.Tensor:
    """``N x 8 x 8`` raw digits (0..16) -> ``N x 1 x S x S`` float32 normalised images."""
    images = torch.as_tensor(raw, dtype=torch.float32).unsqueeze(1) / DIGITS_MAX_VALUE
    if images.shape[-1] != image_size:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear",
                               align_corners=False, antialias=True)
    return (images - mean) / std


class Digits(ImageDataModule):
    """scikit-learn digits, 1 channel, resized to ``image_size``; needs no files.

    Args as ``ImageDataModule`` (without ``data_dir``); horizontal flip is off by default
    because a mirrored digit is another symbol, the random crop stays on.
    """

    dataset_name = "Digits"
    num_classes = 10
    in_chans = 1
    default_mean = DIGITS_MEAN
    default_std = DIGITS_STD

    def __init__(
        self,
        batch_size: int = 128,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        image_size: int = 32,
        train_augmentation: bool = True,
        horizontal_flip: bool = False,
        crop_scale: tuple[float, float] = (0.2, 1.0),
        mean: tuple[float] | None = None,
        std: tuple[float] | None = None,
        pin_memory: bool = False,
        drop_last_train: bool = True,
        persistent_workers: bool = True,
        rand_augment: str | None = None,
        random_erasing: float = 0.0,
    ) -> None:
        super().__init__(data_dir=None, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         num_workers=num_workers, image_size=image_size,
                         train_augmentation=train_augmentation, horizontal_flip=horizontal_flip, crop_scale=crop_scale, eval_crop_ratio=1.0,
                         mean=mean, std=std, pin_memory=pin_memory, drop_last_train=drop_last_train,
                         persistent_workers=persistent_workers,
                         rand_augment=rand_augment, random_erasing=random_erasing)

    def load_split(self, train: bool) -> Dataset:
        """The split's images, already resized and normalised, as one in-memory tensor."""
        digits = load_digits()
        train_idx, held_out_idx = digits_split_indices(digits.target)
        idx = train_idx if train else held_out_idx
        images = digits_to_tensor(digits.images[idx], self.image_size, self.mean[0], self.std[0])
        return InMemoryImages(images, torch.as_tensor(digits.target[idx], dtype=torch.int64))

    def train_transform(self) -> Callable[[Any], torch.Tensor]:
        """RandomResizedCrop (and flip if asked) of the ready normalised tensor."""
        steps: list[Callable] = [v2.RandomResizedCrop(self.image_size, scale=self.crop_scale,
                                                      interpolation=InterpolationMode.BICUBIC,
                                                      antialias=True)]
        if self.horizontal_flip:
            steps.append(v2.RandomHorizontalFlip())
        return v2.Compose(steps)

    def wrap_eval(self, samples: Dataset) -> Dataset:
        """Eval samples are the stored tensors themselves: the transform was applied in setup."""
        return samples
