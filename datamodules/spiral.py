"""Two-arm spiral, the ResidualDroppath paper's toy data (the ResidualDroppath paper, section 3; "ResidualDroppath",
section 3.1 and figure 2).

Train set: ``num_points / 2`` angles ``a ~ U(0, 2 pi)`` with radius ``r = a / (2 pi)``; each
angle gives one point of each class, as in the paper: class 0 at angle ``a``, class 1 at
``a + pi``, a point being ``(r sin(angle), r cos(angle))``. The validation set is drawn the
same way from another seed. Test and predict set: the ``grid_size x grid_size`` grid over
``[-1, 1]^2`` (point ``k`` is ``(xs[k % grid_size], xs[k // grid_size])``, ``xs`` evenly spaced),
labelled with the class of the nearest spiral arm (distance to each arm sampled at 4096 + 1
angles). Batches are ``(float32 B x 2 points, int64 B labels)``.
"""
from __future__ import annotations

import math

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from datamodules.resumable import ResumableTrainData

ARM_SAMPLES = 4096


def spiral_points(num_points: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_points`` spiral points (half per class, class 0 first) and their int64 labels."""
    if num_points < 2 or num_points % 2:
        raise ValueError(f"num_points must be an even number >= 2 (one point per class per angle), "
                         f"got {num_points}")
    gen = torch.Generator().manual_seed(seed)
    angle = torch.rand(num_points // 2, generator=gen, dtype=torch.float64) * (2 * math.pi)
    radius = angle / (2 * math.pi)
    angles = torch.cat([angle, angle + math.pi])
    radii = torch.cat([radius, radius])
    points = torch.stack([radii * torch.sin(angles), radii * torch.cos(angles)], dim=1)
    labels = torch.arange(2).repeat_interleave(num_points // 2)
    return points.float(), labels


def grid_points(grid_size: int = 50, low: float = -1.0, high: float = 1.0) -> torch.Tensor:
    """``grid_size^2 x 2`` points; point ``k`` is ``(xs[k % grid_size], xs[k // grid_size])``."""
    if grid_size < 2:
        raise ValueError(f"grid_size must be >= 2, got {grid_size}")
    xs = torch.linspace(low, high, grid_size, dtype=torch.float64)
    ys, xx = torch.meshgrid(xs, xs, indexing="ij")
    return torch.stack([xx.reshape(-1), ys.reshape(-1)], dim=1).float()


def nearest_arm_labels(points: torch.Tensor, arm_samples: int = ARM_SAMPLES) -> torch.Tensor:
    """Class of the spiral arm nearest to each point (arms sampled at ``arm_samples + 1`` angles)."""
    angle = torch.linspace(0.0, 2 * math.pi, arm_samples + 1, dtype=torch.float64)
    radius = angle / (2 * math.pi)
    arm0 = torch.stack([radius * torch.sin(angle), radius * torch.cos(angle)], dim=1)
    labels = []
    for chunk in points.double().split(256):  # a few MB at a time
        to_arm0 = torch.cdist(chunk, arm0).amin(dim=1)
        to_arm1 = torch.cdist(chunk, -arm0).amin(dim=1)  # the class-1 arm is the class-0 arm turned by pi
        labels.append((to_arm1 < to_arm0).long())
    return torch.cat(labels) if labels else torch.zeros(0, dtype=torch.int64)


class Spiral(ResumableTrainData, L.LightningDataModule):
    """Spiral train/val points and the labelled grid as test/predict set.

    Args:
        num_points: train points (paper: 16,384), even.
        val_points: validation points, even.
        grid_size: test grid side (paper: 50).
        batch_size: train batch (paper: 256).
        eval_batch_size: val/test/predict batch (None: the whole grid, 2500 for 50).
        num_workers: loader workers.
        seed: seed of the train draw; validation uses ``seed + 1``.
    """

    num_classes = 2
    in_features = 2
    # cli.ShortcutLabCLI links these three from every datamodule; points are not images
    in_chans = 2
    image_size = None

    def __init__(self, num_points: int = 16384, val_points: int = 2048, grid_size: int = 50,
                 batch_size: int = 256, eval_batch_size: int | None = None, num_workers: int = 0,
                 seed: int = 0) -> None:
        super().__init__()
        for name, value in (("num_points", num_points), ("val_points", val_points)):
            if value < 2 or value % 2:
                raise ValueError(f"Spiral: {name} must be an even number >= 2, got {value}")
        if grid_size < 2:
            raise ValueError(f"Spiral: grid_size must be >= 2, got {grid_size}")
        if batch_size < 1 or (eval_batch_size is not None and eval_batch_size < 1):
            raise ValueError(f"Spiral: batch_size and eval_batch_size must be >= 1, got {batch_size}, "
                             f"{eval_batch_size}")
        if num_workers < 0:
            raise ValueError(f"Spiral: num_workers must be >= 0, got {num_workers}")
        self.save_hyperparameters()
        self.num_points = num_points
        self.val_points = val_points
        self.grid_size = grid_size
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or grid_size * grid_size
        self.num_workers = num_workers
        self.seed = seed
        self.train_dataset: TensorDataset | None = None
        self.val_dataset: TensorDataset | None = None
        self.test_dataset: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None:
            self.train_dataset = TensorDataset(*spiral_points(self.num_points, self.seed))
            self.val_dataset = TensorDataset(*spiral_points(self.val_points, self.seed + 1))
            grid = grid_points(self.grid_size)
            self.test_dataset = TensorDataset(grid, nearest_arm_labels(grid))

    def _loader(self, dataset: TensorDataset | None, batch_size: int, shuffle: bool = False) -> DataLoader:
        if dataset is None:
            raise RuntimeError("Spiral: call setup() before asking for a loader")
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=self.num_workers)

    def train_dataloader(self) -> DataLoader:
        """Shuffled by epoch, resumable mid-epoch (``datamodules.resumable``)."""
        if self.train_dataset is None:
            raise RuntimeError("Spiral: call setup() before asking for a loader")
        return self.resumable_train_loader(self.train_dataset, self.batch_size, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, self.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_dataset, self.eval_batch_size)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_dataset, self.eval_batch_size)
