"""The ImageNet data pipeline at GPU rates: images per second one loader
worker decodes and augments with the MAE train transform at 224 px (RandomResizedCrop, bicubic,
scale 0.2-1, flip, normalise), PIL against ``torchvision.io.decode_image`` + ``transforms.v2``
on uint8 tensors and facebookresearch/mae's own pipeline (PIL ``ImageFolder`` and
``torchvision.transforms``), and the workers a GPU needs at the paper's step rate.

The images are real JPEG files (quality 90, ImageNet's usual 500 x 375 and 333 x 500 sizes,
about 80 KB each: smooth colour fields plus noise) in an ImageFolder tree, read through
``datamodules.imagenet.ImageNet``'s own train dataset, one process and one thread: what each
loader worker does per image (collation and the host-to-device copy excluded).

The step rate assumed: Zhang et al. (shared/papers, section 4.1) trained the ViT-B MAE on
ImageNet-1K (1,281,167 images) for 800 epochs in 200 hours on 4 NVIDIA A40 GPUs:
1,423 images/s in all, 356 per GPU. A faster GPU needs proportionally more workers.

The same JPEGs converted by ``shortcutlab chunks`` (a few chunk files instead of a file an image)
are read through the same train dataset from the chunks: their images/s against the folder's,
and the number of files each holds.
"""
from __future__ import annotations

import inspect
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from commands import chunks
from datamodules.imagenet import ImageNet, read_rgb_tensor

from .official_loops import mae_loader
from .settings import Settings
from .timing import Row, ratio_row

SECTION = "data pipeline (ImageNet train transform, 224 px)"
PAPER_IMAGES_PER_GPU = 1_281_167 * 800 / (200 * 3600) / 4  # 356 img/s per A40 GPU


def write_jpeg_folder(root: str, per_class: int, seed: int = 0, names: tuple[str, ...] | list[str] = ("n0", "n1"),
                      val_per_class: int = 1, size: tuple[int, int] | None = None) -> None:
    """``root/train/<class>/<i>.JPEG`` for the classes ``names`` (and ``val_per_class`` val images each),
    ``size`` (height, width) pixels, else ImageNet's typical 375 x 500 and 500 x 333 in turn."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", per_class), ("val", val_per_class)):
        for name in names:
            folder = os.path.join(root, split, name)
            os.makedirs(folder, exist_ok=True)
            for i in range(count):
                h, w = size or ((375, 500) if i % 2 else (500, 333))
                field = np.kron(rng.normal(size=(h // 8 + 1, w // 8 + 1, 3)), np.ones((8, 8, 1)))[:h, :w]
                pixels = np.clip((field + 0.3 * rng.normal(size=field.shape)) * 40 + 128, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(os.path.join(folder, f"{i}.JPEG"), quality=90)


class DecodedOnly(torch.utils.data.Dataset):
    """``read(source)`` of each ``(source, label)`` sample: reading and decoding without a transform."""

    def __init__(self, samples: torch.utils.data.Dataset, read) -> None:  # noqa: ANN001 (a loader)
        self.samples, self.read = samples, read

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.read(self.samples[index][0])


def images_per_second(dataset: torch.utils.data.Dataset, passes: int) -> float:
    start = time.perf_counter()
    for _ in range(passes):
        for i in range(len(dataset)):
            dataset[i]
    return passes * len(dataset) / (time.perf_counter() - start)


def run(settings: Settings) -> list[Row]:
    per_class, passes = settings.pick(24, 2), settings.pick(2, 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one loader worker = one process, one thread
    try:
        with tempfile.TemporaryDirectory() as root:
            write_jpeg_folder(root, per_class)
            datasets = {}
            for decoder in ("torchvision", "pil"):
                data = ImageNet(data_dir=root, num_classes=2, image_size=224, decoder=decoder)
                data.setup("fit")
                datasets[decoder] = data.train_dataset
            datasets["official"] = mae_loader(Path(root) / "train", 224, 1, 0).dataset
            converted = os.path.join(root, "chunks")
            chunks.main([root, converted, "--num_workers", "1", "--no_progress", "--chunk_bytes", "16MB"])
            data = ImageNet(data_dir=converted, num_classes=2, image_size=224)
            data.setup("fit")
            datasets["chunks"] = data.train_dataset
            # decoding alone (read + decode_image to RGB, no transform): what the storage changes
            datasets["decoded, folder"] = DecodedOnly(datasets["torchvision"].samples.samples, read_rgb_tensor)
            datasets["decoded, chunks"] = DecodedOnly(data.train_dataset.samples.samples, read_rgb_tensor)
            files = {"folder": sum(len(f) for _, _, f in os.walk(os.path.join(root, "train"))) +
                     sum(len(f) for _, _, f in os.walk(os.path.join(root, "val"))),
                     "chunks": sum(len(f) for _, _, f in os.walk(converted))}
            for dataset in datasets.values():
                dataset[0]  # warm-up: first-call costs out of the timing
            rates: dict[str, list[float]] = {name: [] for name in datasets}
            for _ in range(settings.rounds):
                for decoder, dataset in datasets.items():
                    rates[decoder].append(images_per_second(dataset, passes))
    finally:
        torch.set_num_threads(threads)
    tv, pil = statistics.median(rates["torchvision"]), statistics.median(rates["pil"])
    default = inspect.signature(ImageNet).parameters["decoder"].default
    fastest = tv if default == "torchvision" else pil
    return [
        ratio_row(SECTION, "images/s per worker, torchvision decode_image + v2 on uint8 tensors",
                  rates["torchvision"], None, "one process, one thread, 224 px train transform", unit="img/s"),
        ratio_row(SECTION, "images/s per worker, PIL decode + v2 on PIL images", rates["pil"], None,
                  "the same images and transform", unit="img/s"),
        ratio_row(SECTION, f"default decoder ({default}) / the other, images/s",
                  [(a / b if default == "torchvision" else b / a) for a, b in zip(rates["torchvision"], rates["pil"])],
                  ">= 1.00", "the faster decoder is ImageNet's default"),
        ratio_row(SECTION, "images decoded per second from chunks (shortcutlab chunks) / from the ImageFolder",
                  [a / b for a, b in zip(rates["decoded, chunks"], rates["decoded, folder"])], ">= 1.00",
                  "the same JPEGs read and decoded to RGB (torchvision decode_image), no transform"),
        ratio_row(SECTION, "images/s per worker from chunks / from the ImageFolder, with the train transform",
                  [a / b for a, b in zip(rates["chunks"], rates["torchvision"])], None,
                  "the same JPEG bytes, decoder and 224 px transform; read from litdata chunk files"),
        Row(SECTION, "files holding the train and val images: ImageFolder / chunks (shortcutlab chunks)",
            files["folder"] / files["chunks"], files["folder"] / files["chunks"], None, "x",
            f"{files['folder']} image files against {files['chunks']} chunk and index files (ImageNet-1K: "
            "1,331,167 files against about 2,300 chunks of 64 MB)"),
        ratio_row(SECTION, "images/s per worker, facebookresearch/mae's pipeline (PIL ImageFolder + transforms)",
                  rates["official"], None, "RandomResizedCrop(224, (0.2, 1), bicubic), flip, ToTensor, Normalize",
                  unit="img/s"),
        ratio_row(SECTION, f"default decoder ({default}) / facebookresearch/mae's pipeline, images/s per worker",
                  [a / b for a, b in zip(rates[default], rates["official"])], ">= 1.00",
                  "the same files, one worker each"),
        Row(SECTION, "loader workers per GPU at the paper's ViT-B MAE step rate (356 img/s per A40)",
            PAPER_IMAGES_PER_GPU / fastest, PAPER_IMAGES_PER_GPU / fastest, None, "workers",
            f"{PAPER_IMAGES_PER_GPU:.0f} img/s per GPU (1.28 M images x 800 epochs in 200 h on 4 A40s) / "
            f"{fastest:.0f} img/s per worker; an 8-GPU node: {8 * PAPER_IMAGES_PER_GPU / fastest:.0f} workers"),
    ]
