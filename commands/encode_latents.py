"""Pre-encode an image dataset into VAE latents once, for latent diffusion (the decay paper, section 5,
ImageNet-100 on a pretrained VAE's 32x32x4 latents; U-ViT extracts them the same way).

    python -m commands.encode_latents --vae-path pretrained/sd-vae-ft-ema \\
        --data datamodules.imagenet.ImageNet --data.data_dir data/imagenet \\
        --data.class_list configs/imagenet100_classes.txt --data.image_size 256 \\
        --data.eval_crop_ratio 1.0 --out data/imagenet100_latents --hflip true

Both splits are read through the datamodule's eval transform (train: its kNN-bank copy, no
augmentation), mapped back to ``[-1, 1]`` pixels and encoded. Written to ``--out``:

- ``<split>_<i>.pt`` part files: ``mean``, ``std`` (the unscaled posterior, float16 by default,
  ``N x C x h x w``), ``labels`` (int64), and with ``--hflip`` ``flip_mean``/``flip_std`` of
  the mirrored images;
- ``metadata.json``: ``scaling_factor``, ``shift_factor``, ``latent_channels``,
  ``latent_size``, ``num_classes``, ``class_names`` (the image datamodule's, or null),
  ``image_size``, the part files' names and sizes of each split.

A progress bar over each split's batches on a terminal (``--quiet``: none).

``datamodules.latents.Latents`` reads them.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from rich.progress import Progress
from torch.utils.data import DataLoader, Dataset

from commands._progress import command_progress, show_progress, tracked
from commands._renamed_options import renamed_options
from datamodules.latents import METADATA_FILE
from lightning_mods._generation.latent_vae import FrozenVAE

SPLITS = ("train", "val")


def to_vae_input(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, vae_channels: int) -> torch.Tensor:
    """Normalised ``B x C x H x W`` images -> ``[-1, 1]`` pixels with the VAE's channel count."""
    pixels = (images.float() * std + mean).clamp(0.0, 1.0) * 2.0 - 1.0
    if pixels.shape[1] == vae_channels:
        return pixels
    if pixels.shape[1] == 1:
        return pixels.expand(-1, vae_channels, -1, -1)
    raise ValueError(f"data: images have {pixels.shape[1]} channels but the VAE takes {vae_channels}")


@torch.no_grad()
def encode_split(vae: FrozenVAE, dataset: Dataset, mean: tuple[float, ...], std: tuple[float, ...], out_dir: str,
                 split: str, batch_size: int = 64, num_workers: int = 0, part_size: int = 10000,
                 hflip: bool = False, dtype: torch.dtype = torch.float16,
                 device: torch.device = torch.device("cpu"), progress: Optional[Progress] = None) -> dict:
    """Encode one split into parts; returns ``{"num_samples", "parts": [{"file", "num_samples"}]}``
    (with ``progress``, a bar over the batches)."""
    if part_size % batch_size:
        part_size = max(batch_size, part_size // batch_size * batch_size)  # whole batches per part
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers)
    mean_t = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=device).view(1, -1, 1, 1)
    keys = ("mean", "std", "flip_mean", "flip_std") if hflip else ("mean", "std")
    buffer: dict[str, list[torch.Tensor]] = {k: [] for k in (*keys, "labels")}
    parts: list[dict] = []

    def flush() -> None:
        if not buffer["labels"]:
            return
        part = {k: torch.cat(v) for k, v in buffer.items()}
        name = f"{split}_{len(parts):05d}.pt"
        torch.save(part, os.path.join(out_dir, name))
        parts.append({"file": name, "num_samples": int(part["labels"].shape[0])})
        for v in buffer.values():
            v.clear()

    buffered = 0
    for images, labels in tracked(progress, loader, f"encode the {split} split (batches of {batch_size})"):
        pixels = to_vae_input(images.to(device), mean_t, std_t, vae.image_channels)
        moments = list(vae.encode_moments(pixels))
        if hflip:
            moments += list(vae.encode_moments(pixels.flip(-1)))
        for key, value in zip(keys, moments):
            buffer[key].append(value.to(dtype).cpu())
        buffer["labels"].append(torch.as_tensor(labels, dtype=torch.int64))
        buffered += len(labels)
        if buffered >= part_size:
            flush()
            buffered = 0
    flush()
    return {"num_samples": sum(s["num_samples"] for s in parts), "parts": parts}


def encode_dataset(vae_path: str, datamodule, out: str, batch_size: int = 64, num_workers: int = 0,  # noqa: ANN001
                   part_size: int = 10000, hflip: bool = False, dtype: str = "float16",
                   device: str = "auto", scaling_factor: Optional[float] = None,
                   splits: tuple[str, ...] = SPLITS, progress: Optional[Progress] = None) -> dict:
    """Encode ``splits`` of an image datamodule into ``out``; returns the metadata written."""
    if dtype not in ("float16", "float32"):
        raise ValueError(f"dtype must be 'float16' or 'float32', got {dtype!r}")
    bad = [s for s in splits if s not in SPLITS]
    if bad or not splits:
        raise ValueError(f"splits must be a non-empty subset of {', '.join(SPLITS)}; got {list(splits)}")
    torch_device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    vae = FrozenVAE(vae_path, scaling_factor=scaling_factor)
    os.makedirs(out, exist_ok=True)
    datamodule.setup("fit")
    sources = {"train": datamodule.bank_dataset, "val": datamodule.val_dataset}
    metadata = {
        "vae_path": os.path.abspath(vae_path),
        "scaling_factor": vae.scaling_factor,
        "shift_factor": vae.shift_factor,
        "latent_channels": vae.latent_channels,
        "latent_size": datamodule.image_size // vae.downsample_factor,
        "image_size": datamodule.image_size,
        "num_classes": int(datamodule.num_classes),
        "class_names": list(getattr(datamodule, "class_names", None) or []) or None,  # for the sample pictures
        "source": f"{type(datamodule).__module__}.{type(datamodule).__name__}",
        "hflip": bool(hflip),
        "dtype": dtype,
        "splits": {},
    }
    for split in splits:
        metadata["splits"][split] = encode_split(
            vae, sources[split], datamodule.mean, datamodule.std, out, split, batch_size=batch_size,
            num_workers=num_workers, part_size=part_size, hflip=hflip, dtype=getattr(torch, dtype),
            device=torch_device, progress=progress)
    with open(os.path.join(out, METADATA_FILE), "w") as f:
        json.dump(metadata, f, indent=2)
    return metadata


def main(args: Optional[list[str]] = None) -> dict:
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningDataModule

    parser = ArgumentParser(prog="python -m commands.encode_latents", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae-path", type=str, required=True, help="local AutoencoderKL folder (save_pretrained)")
    parser.add_subclass_arguments(LightningDataModule, "data", required=True,
                                  help="the image datamodule, e.g. datamodules.imagenet.ImageNet")
    parser.add_argument("--out", type=str, required=True, help="output folder for the part files and metadata.json")
    parser.add_argument("--splits", type=list[str], default=list(SPLITS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--part-size", type=int, default=10000, help="images per part file")
    parser.add_argument("--hflip", type=bool, default=False, help="also encode the mirrored images")
    parser.add_argument("--dtype", type=str, default="float16")
    parser.add_argument("--device", type=str, default="auto")
    parser.add_argument("--scaling-factor", type=Optional[float], default=None,
                        help="latent scale (default: the VAE config's scaling_factor)")
    parser.add_argument("--quiet", type=bool, default=False,
                        help="no progress bars (also off when stderr is not a terminal)")
    cfg = parser.parse_args(renamed_options(args, {"--shard-size": "--part-size"}, "encode_latents"))
    datamodule = parser.instantiate(cfg).data
    with command_progress(show_progress(cfg.quiet)) as progress:
        metadata = encode_dataset(cfg.vae_path, datamodule, cfg.out, batch_size=cfg.batch_size,
                                  num_workers=cfg.num_workers, part_size=cfg.part_size, hflip=cfg.hflip,
                                  dtype=cfg.dtype, device=cfg.device, scaling_factor=cfg.scaling_factor,
                                  splits=tuple(cfg.splits), progress=progress)
    sizes = ", ".join(f"{s}: {v['num_samples']}" for s, v in metadata["splits"].items())
    print(f"encoded {sizes} images into {metadata['latent_channels']}x{metadata['latent_size']}x"
          f"{metadata['latent_size']} latents under {cfg.out}")
    return metadata


if __name__ == "__main__":
    main()
