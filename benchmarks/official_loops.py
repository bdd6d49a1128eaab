"""The papers' own training loops, written again here as plain PyTorch around this package's
networks: the peers a ``shortcutlab fit`` is measured against in the breakdown
(:mod:`benchmarks.fit_breakdown`, ``make gpu-check ARGS="--parts breakdown"``).

- :func:`mae_loop`: facebookresearch/mae's ``main_pretrain.py`` / ``engine_pretrain.py``:
  ``ImageFolder`` with PIL decoding, ``RandomResizedCrop(size, scale=(0.2, 1.0), bicubic)``,
  horizontal flip, ``ToTensor``, ImageNet normalisation; a ``DataLoader`` with the config's
  workers, pinned memory, ``drop_last``; each step the batch copied non-blocking, the loss
  under autocast, backward, the optimiser step, ``zero_grad`` and one host read of the loss
  (``loss.item()``, as its loop reads it to check for NaN).
- :func:`uvit_loop`: baofff/U-ViT's ``train.py`` on CIFAR: the dataset with a random horizontal
  flip and ``[-1, 1]`` scaling, 8 workers, pinned memory, ``drop_last``; each step the loss,
  backward, the optimiser step, its EMA as a Python loop over the parameters
  (``p_ema.mul_(decay).add_((1 - decay) * p)``, as its ``ema`` function), ``zero_grad``.

Both take the same LightningModule the fit builds (its network, its loss) and its fused AdamW,
so the difference to the fit is the data pipeline and the loop around the step alone.
"""
from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, Dataset

from .settings import Settings
from .timing import synchronize

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MAE_SOURCE = "facebookresearch/mae's loop"
UVIT_SOURCE = "baofff/U-ViT's loop"
UVIT_WORKERS = 8  # baofff/U-ViT's train.py


def mae_loader(train_dir: Path, image_size: int, batch_size: int, workers: int) -> DataLoader:
    """facebookresearch/mae's pre-training data: PIL decode, bicubic RandomResizedCrop of scale
    (0.2, 1), flip, ToTensor, ImageNet normalisation, in ``workers`` processes."""
    from torchvision import datasets, transforms

    transform = transforms.Compose([
        transforms.RandomResizedCrop(image_size, scale=(0.2, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(), transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    dataset = datasets.ImageFolder(str(train_dir), transform=transform)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers, pin_memory=True,
                      drop_last=True, persistent_workers=workers > 0)


class PILImages(Dataset):
    """CIFAR's training images as torchvision's ``CIFAR100`` hands them out: a PIL image per item
    (``Image.fromarray`` of the HWC bytes) through ``transform``. The pickles are read with this
    package's reader, which does not insist on the official files' md5 sums."""

    def __init__(self, data_dir: Path, transform: Callable[[Any], torch.Tensor]) -> None:
        from datamodules.torchvision_sets import read_cifar_batches

        held = read_cifar_batches([str(Path(data_dir) / "cifar-100-python" / "train")], "fine_labels")
        self.pixels, self.labels = held.images.permute(0, 2, 3, 1).contiguous().numpy(), held.labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        return self.transform(Image.fromarray(self.pixels[index])), self.labels[index]


def uvit_loader(data_dir: Path, batch_size: int, workers: int) -> DataLoader:
    """baofff/U-ViT's CIFAR data: random horizontal flip, ToTensor, scaled to [-1, 1]."""
    from torchvision import transforms

    transform = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                    transforms.Normalize((0.5,) * 3, (0.5,) * 3)])
    return DataLoader(PILImages(data_dir, transform), batch_size=batch_size, shuffle=True, num_workers=workers,
                      pin_memory=True, drop_last=True, persistent_workers=workers > 0)


def ema_python_loop(averaged: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """baofff/U-ViT's EMA update: one multiply and one add per parameter, in a Python loop."""
    with torch.no_grad():
        for p_ema, p in zip(averaged.parameters(), model.parameters()):
            p_ema.mul_(decay).add_((1 - decay) * p)


def endless(loader: DataLoader) -> Iterator[Any]:
    while True:
        yield from loader


def timed_loop(step: Callable[[Any], None], loader: DataLoader, settings: Settings, warmup: int,
               timed: int) -> float:
    """Images per second of ``step`` over ``timed`` batches of ``loader`` after ``warmup``."""
    batches = endless(loader)
    for _ in range(warmup):
        step(next(batches))
    synchronize(settings.torch_device)
    start, images = time.perf_counter(), 0
    for _ in range(timed):
        batch = next(batches)
        step(batch)
        images += len(batch[0])
    synchronize(settings.torch_device)
    return images / (time.perf_counter() - start)


def _optimizer(model: LightningModule) -> torch.optim.Optimizer:
    from lightning_mods.recipe.optim import adamw, param_groups_weight_decay

    return adamw(param_groups_weight_decay(model, 0.05), lr=1e-4, betas=(0.9, 0.95))


def mae_loop(model: LightningModule, train_dir: Path, image_size: int, batch_size: int, workers: int,
             settings: Settings, warmup: int, timed: int) -> float:
    """facebookresearch/mae's training loop around ``model`` (a MaskedAutoencoder): img/s."""
    device = settings.torch_device
    model.to(device).train()
    optimizer = _optimizer(model)
    losses: list[float] = []

    def step(batch: Any) -> None:
        samples = batch[0].to(device, non_blocking=True)
        with settings.autocast():
            loss, _, _ = model(samples)
        losses.append(loss.item())  # the official loop's one host read a step (its NaN check)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = timed_loop(step, mae_loader(train_dir, image_size, batch_size, workers), settings, warmup, timed)
    if not all(math.isfinite(value) for value in losses):
        raise RuntimeError(f"{MAE_SOURCE}: non-finite loss")
    return result


def uvit_loop(model: LightningModule, data_dir: Path, batch_size: int, workers: int, settings: Settings,
              warmup: int, timed: int, ema_decay: float = 0.9999) -> float:
    """baofff/U-ViT's training loop around ``model`` (a DiffusionModule): img/s."""
    import copy

    device = settings.torch_device
    model.to(device).train()
    averaged = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = _optimizer(model)
    losses: list[torch.Tensor] = []

    def step(batch: Any) -> None:
        images, labels = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
        with settings.autocast():
            # the loader's images are in [-1, 1] already, the diffusion space
            loss = model.diffusion_loss(images, model.condition(labels, model.hparams.label_dropout))
        loss.backward()
        optimizer.step()
        ema_python_loop(averaged, model, ema_decay)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = timed_loop(step, uvit_loader(data_dir, batch_size, workers), settings, warmup, timed)
    if not bool(torch.isfinite(torch.stack(losses)).all()):
        raise RuntimeError(f"{UVIT_SOURCE}: non-finite loss")
    return result
