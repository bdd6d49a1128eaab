"""ImageNet-1K and its ImageNet-100 subset from class folders or their conversion to chunks (the
decay paper, section 4, data and evaluation).

Layout: ``data_dir/train/<wnid>/<image>`` and ``data_dir/val/<wnid>/<image>`` (the usual
ImageFolder layout; the official val images must be sorted into class folders first), or a
conversion of that tree by ``shortcutlab chunks`` (a folder or an object-storage URI: the same
images from a few large files, :mod:`datamodules.streamed_images`; its class list must be the
one asked for).
``class_list`` is a text file with one wnid per line (blank lines ignored): only those classes
are used, labelled 0..n-1 in the file's order (ImageNet-100 is such a list of 100 wnids).
Without it every class folder is used, labelled in sorted order, and their count must equal
``num_classes``. Eval: resize to image_size / 0.875 (256 for 224) then centre crop, as MAE.

An image that cannot be decoded (corrupt, truncated, empty) stops the run with a one-line
:class:`CorruptImageError` naming the file; ``skip_corrupt=True`` warns and uses the next
readable image of the split in its place, so batch sizes and epoch length stay the same.
"""
from __future__ import annotations

import copy
import functools
import os
from typing import Any, Callable, Literal, Sequence

import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.functional import pil_to_tensor

from datamodules.base import ImageDataModule
from datamodules._gpu_decode import EncodedCrop, collate_encoded, transfer_encoded
from datamodules._stored_image import (CorruptImageError, ImageSource, first_readable, image_bytes, image_name,
                                      is_empty, open_image)
from datamodules.chunk_order import ChunkOrder
from datamodules.streamed_images import (SPLITS, Conversion, StreamedImages, StreamedSplit, is_conversion, is_uri,
                                         read_conversion, split_location)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGENET_NUM_CLASSES = 1000


def read_class_list(path: str) -> list[str]:
    """The class names of a class-list file, one per line, in order."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ImageNet: class_list file '{path}' not found (expected one wnid per line)")
    with open(path) as f:
        classes = [line.strip() for line in f if line.strip()]
    if not classes:
        raise ValueError(f"ImageNet: class_list file '{path}' names no class (expected one wnid per line)")
    repeated = sorted({c for c in classes if classes.count(c) > 1})
    if repeated:
        raise ValueError(f"ImageNet: class_list file '{path}' names classes more than once: {', '.join(repeated)}")
    return classes


def subfolders(directory: str) -> list[str]:
    """Sorted names of the folders directly under ``directory`` (none if it does not exist)."""
    return sorted(e.name for e in os.scandir(directory) if e.is_dir()) if os.path.isdir(directory) else []


def read_rgb_image(source: ImageSource) -> Image.Image:
    """The RGB image of a file (or a converted dataset's :class:`StoredImage`), fully decoded; a
    :class:`CorruptImageError` naming it if it cannot be."""
    try:
        with open_image(source) as f:
            return Image.open(f).convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CorruptImageError(f"ImageNet: cannot read image '{image_name(source)}' "
                                f"({'empty file' if is_empty(source) else reason}); "
                                "set data.init_args.skip_corrupt=true to skip such files") from None


def read_rgb_tensor(source: ImageSource) -> torch.Tensor:
    """The RGB image of a file (or :class:`StoredImage`) as a ``3 x H x W`` uint8 tensor, decoded by
    torchvision (libjpeg-turbo for JPEG: about twice PIL's rate with the train transform,
    ``benchmarks/data_pipeline.py``); what torchvision cannot decode goes through PIL
    (:func:`read_rgb_image`), which names it in a :class:`CorruptImageError` if it cannot either."""
    try:
        return decode_image(image_bytes(source), mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError):
        return pil_to_tensor(read_rgb_image(source))


DECODERS = {"torchvision": read_rgb_tensor, "pil": read_rgb_image}


class SelectedClassFolder(ImageFolder):
    """ImageFolder over the given ``classes`` only, labelled by their position in that list.

    ``skip_corrupt``: an unreadable image is replaced, with a warning, by the next readable one.
    """

    def __init__(self, root: str, classes: Sequence[str], skip_corrupt: bool = False,
                 loader: Callable[[ImageSource], Any] = read_rgb_image) -> None:
        self.selected_classes = list(classes)
        self.skip_corrupt = skip_corrupt
        super().__init__(root, loader=loader)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return first_readable(super().__getitem__, index, len(self), self.skip_corrupt, self.root)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:
        present = set(subfolders(directory))
        missing = [name for name in self.selected_classes if name not in present]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"ImageNet: class_list names {len(missing)} class(es) with no folder under "
                             f"'{directory}': {shown}")
        return self.selected_classes, {name: i for i, name in enumerate(self.selected_classes)}


MAX_HOST_WORKERS = 16


def host_workers(processes_per_host: int) -> int:
    """Loader workers of each training process when none are set: under SLURM the task's own
    ``--cpus-per-task`` (``SLURM_CPUS_PER_TASK``), elsewhere the cores this process may run on (its
    CPU affinity) shared by the training processes of the host; less one for the process itself,
    at most :data:`MAX_HOST_WORKERS`."""
    per_task = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit():
        cores = int(per_task)
    else:
        host = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        cores = host // max(1, processes_per_host)
    return max(0, min(cores - 1, MAX_HOST_WORKERS))


class ImageNet(ImageDataModule):
    """ImageNet-1K (or the ``class_list`` subset, e.g. ImageNet-100) from class folders.

    Args:
        data_dir: folder holding ``train/`` and ``val/`` class folders, or a conversion of them
            (``shortcutlab chunks``): its folder, or the URI it was copied to (``s3://...``).
        class_list: text file of the wnids to use, one per line (None: every class folder).
        num_classes: number of classes (None: the class list's length, else 1000); checked
            against the folders in ``setup``.
        skip_corrupt: warn about an unreadable image and use the next readable one in its place
            (default: stop with a one-line error naming the file).
        decoder: ``"torchvision"`` (``torchvision.io.decode_image`` to a uint8 tensor, the
            transforms run on tensors; the faster, ``benchmarks/data_pipeline.py``) or ``"pil"``.
            The two resample slightly differently, so the pixels differ in the last few levels.
            ``"gpu"``: the training images are decoded, cropped, flipped and normalised on the
            device the batch goes to (``datamodules._gpu_decode``; nvJPEG on CUDA, the workers
            only read files); evaluation keeps ``"torchvision"``. Needs the MAE augmentation
            (not ``rand_augment``).
        decode_ahead: with ``decoder="gpu"`` and loader workers, decode the next batch in a
            background thread (on its own CUDA stream) while the step runs
            (``datamodules._decode_ahead``); ``False``: decode each batch when the loop moves it.
        num_workers: loader workers per process (default: from the host's cores, :func:`host_workers`).
        pin_memory: default on (page-locked batches; applied only when they go to a CUDA device).
        cache_dir: where a conversion's chunks read from object storage are kept (None: litdata's
            default); max_cache_size: the most they may take (e.g. ``"100GB"``); past it a chunk is
            deleted once read. storage_options: litdata's options of the object store (an endpoint,
            credentials; None: the storage's usual environment variables).
        train_order: how a conversion's training order is drawn: ``"chunks"`` chunk by chunk
            (:class:`datamodules.chunk_order.ChunkOrder`: from object storage each chunk is fetched
            once an epoch), ``"samples"`` a permutation of every sample (the ImageFolder's order),
            ``"auto"``: chunks from object storage, samples from a folder.
        Others as ``ImageDataModule``; eval resizes to ``image_size / eval_crop_ratio`` then
        centre-crops.
    """

    dataset_name = "ImageNet"
    in_chans = 3
    default_mean = IMAGENET_MEAN
    default_std = IMAGENET_STD

    def __init__(self, data_dir: str = "data/imagenet", class_list: str | None = None,
                 num_classes: int | None = None, batch_size: int = 256, eval_batch_size: int | None = None,
                 num_workers: int | None = None, image_size: int = 224, train_augmentation: bool = True, horizontal_flip: bool = True,
                 crop_scale: tuple[float, float] = (0.2, 1.0), eval_crop_ratio: float = 0.875,
                 mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 pin_memory: bool = True, drop_last_train: bool = True,
                 persistent_workers: bool = True, rand_augment: str | None = None,
                 random_erasing: float = 0.0, skip_corrupt: bool = False,
                 decoder: Literal["torchvision", "pil", "gpu"] = "torchvision", decode_ahead: bool = True,
                 cache_dir: str | None = None, max_cache_size: str = "100GB",
                 storage_options: dict[str, Any] | None = None,
                 train_order: Literal["auto", "chunks", "samples"] = "auto") -> None:
        if decoder not in (*DECODERS, "gpu"):
            raise ValueError(f"ImageNet: decoder must be one of {(*DECODERS, 'gpu')}, got {decoder!r}")
        if train_order not in ("auto", "chunks", "samples"):
            raise ValueError(f"ImageNet: train_order must be 'auto', 'chunks' or 'samples', got {train_order!r}")
        if decoder == "gpu" and (rand_augment is not None or not train_augmentation):
            raise ValueError("ImageNet: decoder='gpu' does the MAE pre-training augmentation on the device; "
                             "use decoder='torchvision' with rand_augment or without train_augmentation")
        classes = read_class_list(class_list) if class_list is not None else None
        if num_classes is not None and num_classes <= 0:
            raise ValueError(f"ImageNet: num_classes must be > 0, got {num_classes}")
        if classes is not None and num_classes is not None and num_classes != len(classes):
            raise ValueError(f"ImageNet: num_classes={num_classes} but class_list '{class_list}' names "
                             f"{len(classes)} classes; leave num_classes unset or make them agree")
        num_classes = len(classes) if classes is not None else (num_classes or IMAGENET_NUM_CLASSES)
        super().__init__(data_dir=data_dir, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         num_workers=0 if num_workers is None else num_workers, image_size=image_size,
                         train_augmentation=train_augmentation, horizontal_flip=horizontal_flip,
                         crop_scale=crop_scale, eval_crop_ratio=eval_crop_ratio, mean=mean, std=std,
                         pin_memory=pin_memory, drop_last_train=drop_last_train,
                         persistent_workers=persistent_workers,
                         rand_augment=rand_augment, random_erasing=random_erasing)
        self.class_list = class_list
        self.skip_corrupt = skip_corrupt
        self.decoder = decoder
        self.decode_ahead = decode_ahead
        self.cache_dir, self.max_cache_size = cache_dir, max_cache_size
        self.storage_options, self.train_order = storage_options, train_order
        self._conversions: dict[str, Conversion] = {}
        self.workers_from_host = num_workers is None  # set in setup, once the processes per host are known
        self.classes: list[str] | None = classes
        self.class_names = classes  # the wnids, when a class list names them
        self.num_classes = num_classes
        self.record_resolved_hparam("num_classes", num_classes)  # the CLI links it into the model

    def setup(self, stage: str | None = None) -> None:
        if self.workers_from_host:
            trainer = getattr(self, "trainer", None)
            self.num_workers = host_workers(int(trainer.num_devices) if trainer is not None else 1)
        super().setup(stage)

    def check_files(self) -> None:
        """One-line error unless both splits have class folders, or are a finished conversion of the
        classes asked for (the CLI asks before it starts any process)."""
        if self.streamed:
            self.resolve_classes()
            return
        for train in (True, False):
            self.class_folders(train)

    @functools.cached_property
    def streamed(self) -> bool:
        """Whether ``data_dir`` is a conversion (``shortcutlab chunks``) rather than class folders."""
        return is_conversion(str(self.data_dir))

    def conversion(self, train: bool) -> Conversion:
        """The converted split, read (and checked) once."""
        split = SPLITS[0] if train else SPLITS[1]
        if split not in self._conversions:
            self._conversions[split] = read_conversion(split_location(str(self.data_dir), split), self.cache_dir,
                                                        self.storage_options)
        return self._conversions[split]

    def split_dir(self, train: bool) -> str:
        return os.path.join(str(self.data_dir), "train" if train else "val")

    def class_folders(self, train: bool) -> list[str]:
        """Sorted class folder names of a split; one-line FileNotFoundError when there are none."""
        directory = self.split_dir(train)
        found = subfolders(directory)
        if not found:
            raise FileNotFoundError(
                f"ImageNet: no class folders under '{directory}' (expected data_dir/train/<wnid>/<image> "
                "and data_dir/val/<wnid>/<image>); set data_dir")
        return found

    def resolve_classes(self) -> list[str]:
        """The classes in label order: the class list, or every train class folder (sorted); for a
        conversion, its classes, which must be those asked for."""
        if self.streamed:
            return self._conversion_classes()
        if self.classes is None:
            found = self.class_folders(train=True)
            if len(found) != self.num_classes:
                raise ValueError(f"ImageNet: num_classes={self.num_classes} but '{self.split_dir(True)}' has "
                                 f"{len(found)} class folders; set num_classes or class_list")
            self.classes = found
        return self.classes

    def _conversion_classes(self) -> list[str]:
        found = [self.conversion(train).classes for train in (True, False)]
        if found[0] != found[1]:
            raise ValueError(f"ImageNet: the conversion at '{self.data_dir}' has other classes in train and val")
        converted = found[0]
        if self.classes is not None and converted != self.classes:
            differ = "the same classes in another order" if sorted(converted) == sorted(self.classes) else \
                f"{len(converted)} classes"
            raise ValueError(f"ImageNet: the conversion at '{self.data_dir}' holds {differ}, class_list "
                             f"'{self.class_list}' names {len(self.classes)}; convert with that class list "
                             "(shortcutlab chunks --class_list) or use the conversion's")
        if self.classes is None and len(converted) != self.num_classes:
            raise ValueError(f"ImageNet: num_classes={self.num_classes} but the conversion at '{self.data_dir}' holds "
                             f"{len(converted)} classes; set num_classes or class_list")
        self.classes = converted
        return converted

    def make_train_datasets(self) -> tuple[Dataset, Dataset]:
        if self.decoder != "gpu":
            return super().make_train_datasets()
        samples = self.load_split(train=True)
        encoded = copy.copy(samples)  # the same file list; the workers read bytes and draw the crops
        encoded.loader = EncodedCrop(self.crop_scale, self.horizontal_flip, read_pixels=read_rgb_tensor)
        return self.wrap_eval(samples), encoded

    def train_loader_options(self) -> dict[str, Any]:
        sampler = self.chunk_order()
        options = {} if sampler is None else {"sampler": sampler}
        return {**options, **self.decoder_loader_options()}

    def chunk_order(self) -> ChunkOrder | None:
        """The conversion's chunk-by-chunk training order, when ``train_order`` asks for it."""
        if not self.streamed or self.train_order == "samples":
            return None
        conversion = self.conversion(train=True)
        if self.train_order == "auto" and not is_uri(conversion.location):
            return None
        trainer = getattr(self, "trainer", None)
        world, rank = (int(trainer.world_size), int(trainer.global_rank)) if trainer is not None else (1, 0)
        return ChunkOrder([int(c["chunk_size"]) for c in conversion.chunks], conversion.index_at, world, rank)

    def decoder_loader_options(self) -> dict[str, Any]:
        # encoded batches: bytes that stay on the host (decode_jpeg reads them there), decoded on
        # the device one batch ahead while the step runs (datamodules/_decode_ahead.py)
        if self.decoder != "gpu":
            return {}
        options: dict[str, Any] = {"collate_fn": collate_encoded, "pin_memory": False}
        if self.decode_ahead:
            device = self.train_device()
            options.update(prepare_ahead=functools.partial(transfer_encoded, device=device, image_size=self.image_size,
                                                           mean=self.mean, std=self.std), ahead_device=device)
        return options

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Encoded training batches are decoded and augmented on ``device``; others move as they are."""
        decoded = transfer_encoded(batch, device, self.image_size, self.mean, self.std)
        return decoded if decoded is not None else super().transfer_batch_to_device(batch, device, dataloader_idx)

    def load_split(self, train: bool) -> Dataset:
        classes = self.resolve_classes()
        decoder = DECODERS["torchvision" if self.decoder == "gpu" else self.decoder]
        if self.streamed:
            split = StreamedSplit(self.conversion(train), self.cache_dir, self.max_cache_size, self.storage_options)
            return StreamedImages(split, decoder, self.skip_corrupt)
        self.class_folders(train)
        try:
            return SelectedClassFolder(self.split_dir(train), classes, skip_corrupt=self.skip_corrupt,
                                       loader=decoder)
        except FileNotFoundError as err:  # torchvision: "Found no valid file for the classes ..."
            first = str(err).strip().splitlines()[0][:300]
            raise FileNotFoundError(f"ImageNet: class folders without images under '{self.split_dir(train)}' "
                                    f"({first})") from None
