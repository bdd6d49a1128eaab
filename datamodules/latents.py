"""VAE latents written once by ``python -m commands.encode_latents`` (the decay paper, section 5,
latent diffusion on ImageNet-100).

A sample is ``((z - shift_factor) * scaling_factor, label)`` with ``z`` the stored posterior:
in training a posterior sample ``mean + std * eps`` (``sample_posterior``) of the image or,
with ``random_flip`` and latents encoded with ``--hflip``, of its mirror with probability 1/2;
in evaluation (val, kNN bank) the posterior mean of the image. The parts are memory-mapped.

As every datamodule (docs/contracts.md): ``num_classes``, ``image_size`` (the latent side),
``in_chans`` (latent channels), ``mean``/``std`` (0 and 1: latents are not normalised further)
are known right after ``__init__``; ``scaling_factor`` is there too, for the model to check.
"""
from __future__ import annotations

import bisect
import json
import os

import torch
from torch.utils.data import Dataset

from datamodules.base import ImageDataModule

METADATA_FILE = "metadata.json"  # written by commands.encode_latents


def read_metadata(latent_dir: str) -> dict:
    path = os.path.join(latent_dir, METADATA_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Latents: no {METADATA_FILE} under '{latent_dir}'; write the latents with "
                                "`python -m commands.encode_latents --vae-path ... --data ... --out DIR`")
    with open(path) as f:
        return json.load(f)


class LatentDataset(Dataset):
    """The parts of one split as ``(scaled latent float32 C x h x w, int64 label)``.

    Args:
        parts: loaded part dicts (``mean``, ``std``, ``labels`` [, ``flip_mean``, ``flip_std``]).
        scaling_factor, shift_factor: ``(z - shift) * scale``.
        sample_posterior: ``mean + std * eps`` instead of the mean.
        random_flip: use the mirrored image's latents with probability 1/2.
    """

    def __init__(self, parts: list[dict], scaling_factor: float, shift_factor: float = 0.0,
                 sample_posterior: bool = False, random_flip: bool = False) -> None:
        if random_flip and any("flip_mean" not in s for s in parts):
            raise ValueError("random_flip: these latents were encoded without --hflip (no flip_mean in the parts)")
        self.parts = parts
        self.scaling_factor = float(scaling_factor)
        self.shift_factor = float(shift_factor)
        self.sample_posterior = sample_posterior
        self.random_flip = random_flip
        self.offsets = [0]
        for part in parts:
            self.offsets.append(self.offsets[-1] + int(part["labels"].shape[0]))

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        s = bisect.bisect_right(self.offsets, index) - 1
        part, i = self.parts[s], index - self.offsets[s]
        prefix = "flip_" if self.random_flip and torch.rand(()) < 0.5 else ""
        z = part[prefix + "mean"][i].float()
        if self.sample_posterior:
            z = z + part[prefix + "std"][i].float() * torch.randn_like(z)
        return (z - self.shift_factor) * self.scaling_factor, part["labels"][i]


class Latents(ImageDataModule):
    """Pre-encoded VAE latents of an image dataset (``train`` and ``val`` splits).

    Args:
        latent_dir: the ``--out`` folder of ``commands.encode_latents``.
        sample_posterior: train on posterior samples (else the posterior mean).
        random_flip: train on the mirrored image's latents half of the time (None: when the
            latents were encoded with ``--hflip``).
        Others as ``ImageDataModule``.
    """

    dataset_name = "Latents"

    def __init__(self, latent_dir: str = "data/latents", batch_size: int = 256, eval_batch_size: int | None = None,
                 num_workers: int = 0, sample_posterior: bool = True, random_flip: bool | None = None,
                 pin_memory: bool = False, drop_last_train: bool = True, persistent_workers: bool = True) -> None:
        self.metadata = read_metadata(latent_dir)
        meta = self.metadata
        self.num_classes = int(meta["num_classes"])
        self.class_names = meta.get("class_names")  # absent from latents encoded before it was recorded
        self.in_chans = int(meta["latent_channels"])
        self.scaling_factor = float(meta["scaling_factor"])
        self.shift_factor = float(meta.get("shift_factor") or 0.0)
        if random_flip and not meta.get("hflip", False):
            raise ValueError(f"random_flip: the latents in '{latent_dir}' were encoded without --hflip")
        super().__init__(data_dir=latent_dir, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         num_workers=num_workers, image_size=int(meta["latent_size"]),
                         mean=(0.0,) * self.in_chans, std=(1.0,) * self.in_chans, pin_memory=pin_memory,
                         drop_last_train=drop_last_train, persistent_workers=persistent_workers)
        self.sample_posterior = sample_posterior
        self.random_flip = bool(meta.get("hflip", False)) if random_flip is None else random_flip

    def load_parts(self, split: str) -> list[dict]:
        """The part files of ``split``, memory-mapped (weights-only loads)."""
        info = self.metadata["splits"].get(split)
        if info is None:
            raise FileNotFoundError(f"Latents: '{self.data_dir}' has no {split!r} split; encoded: "
                                    f"{', '.join(self.metadata['splits']) or 'none'}")
        parts = []
        for entry in info.get("parts", info.get("shards", [])):  # "shards" before release 0.3
            path = os.path.join(self.data_dir, entry["file"])
            if not os.path.isfile(path):
                raise FileNotFoundError(f"Latents: part '{path}' listed in {METADATA_FILE} is missing")
            parts.append(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
        return parts

    def make_dataset(self, parts: list[dict], train: bool) -> LatentDataset:
        return LatentDataset(parts, self.scaling_factor, self.shift_factor,
                             sample_posterior=train and self.sample_posterior,
                             random_flip=train and self.random_flip)

    def load_split(self, train: bool) -> Dataset:
        """Evaluation view of a split: posterior means, no flip."""
        return self.make_dataset(self.load_parts("train" if train else "val"), train=False)

    def make_train_datasets(self) -> tuple[Dataset, Dataset]:
        """Bank (posterior means) and train (posterior samples, flips) views of the same parts."""
        parts = self.load_parts("train")
        return self.make_dataset(parts, train=False), self.make_dataset(parts, train=True)

    def wrap_eval(self, samples: Dataset) -> Dataset:
        return samples  # no image transform: latents are ready
