"""CIFAR-10, CIFAR-100 and MNIST datamodules (the decay paper, section 4, data; the smaller benchmarks).

``download=True`` fetches the files with torchvision into ``data_dir`` (``prepare_data``, rank 0);
otherwise nothing is fetched and a missing root fails in ``setup`` with one line saying which
files were expected where. The splits are read straight from torchvision's on-disk layout
into one uint8 tensor each (CIFAR: the python pickle batches, read here with an unpickler that
runs no code from them, ``datamodules/cifar_pickle.py``, where torchvision would ``pickle.load``
them and insist on the official md5 sums; MNIST: torchvision's idx reader), so an item costs
only its transform.
"""
from __future__ import annotations

import os
from typing import ClassVar, Sequence

import numpy as np
import torch
import torchvision
from torch.utils.data import Dataset
from torchvision.datasets.utils import download_and_extract_archive

from datamodules.base import ImageDataModule, InMemoryImages
from datamodules.cifar_pickle import UnsafeDataFileError, load_cifar_batch

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)
MNIST_MEAN = (0.1307,)
MNIST_STD = (0.3081,)


def read_cifar_batches(paths: Sequence[str], label_key: str) -> InMemoryImages:
    """CIFAR python pickle batches -> ``N x 3 x 32 x 32`` uint8 images and int64 labels.

    Each batch holds ``data`` (N x 3072 uint8, the red, green then blue 32x32 planes, row-major)
    and the labels under ``label_key`` (``labels`` for CIFAR-10, ``fine_labels`` for CIFAR-100).
    """
    images, labels = [], []
    for path in paths:
        batch = load_cifar_batch(path, required=("data", label_key))
        data = np.asarray(batch["data"])
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(batch[label_key]):
            raise UnsafeDataFileError(f"'{path}' is not a CIFAR python batch (data is {data.dtype} "
                                      f"{data.shape} for {len(batch[label_key])} labels; expected uint8 N x 3072)")
        images.append(data.reshape(-1, 3, 32, 32))
        labels.extend(batch[label_key])
    return InMemoryImages(torch.from_numpy(np.concatenate(images)), torch.as_tensor(labels, dtype=torch.int64))


class TorchvisionDataModule(ImageDataModule):
    """A dataset whose files torchvision can download into ``data_dir``.

    A subclass names its files: ``folder_parts`` (their folder under ``data_dir``),
    ``file_names``, ``files_description`` and ``expected_text`` (for the error message).

    Args:
        download: fetch the files into ``data_dir`` in ``prepare_data`` when they are missing.
        Others as ``ImageDataModule``.
    """

    torchvision_class: ClassVar[type]
    folder_parts: ClassVar[tuple[str, ...]]
    file_names: ClassVar[tuple[str, ...]]
    files_description: ClassVar[str]
    expected_text: ClassVar[str]

    def __init__(self, data_dir: str = "data", batch_size: int = 256, eval_batch_size: int | None = None,
                 num_workers: int = 0, image_size: int = 32, download: bool = False,
                 train_augmentation: bool = True, horizontal_flip: bool = True, crop_scale: tuple[float, float] = (0.2, 1.0),
                 eval_crop_ratio: float = 1.0, mean: Sequence[float] | None = None,
                 std: Sequence[float] | None = None, pin_memory: bool = False,
                 drop_last_train: bool = True, persistent_workers: bool = True, rand_augment: str | None = None,
                 random_erasing: float = 0.0) -> None:
        super().__init__(data_dir=data_dir, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         num_workers=num_workers, image_size=image_size, train_augmentation=train_augmentation, horizontal_flip=horizontal_flip,
                         crop_scale=crop_scale, eval_crop_ratio=eval_crop_ratio, mean=mean, std=std,
                         pin_memory=pin_memory, drop_last_train=drop_last_train,
                         persistent_workers=persistent_workers,
                         rand_augment=rand_augment, random_erasing=random_erasing)
        self.download = download

    def prepare_data(self) -> None:
        if self.download:
            for train in (True, False):
                self.torchvision_class(str(self.data_dir), train=train, download=True)

    def files_folder(self) -> str:
        return os.path.join(str(self.data_dir), *self.folder_parts)

    def missing_files(self) -> list[str]:
        folder = self.files_folder()
        return [name for name in self.file_names if not os.path.isfile(os.path.join(folder, name))]

    def check_files(self) -> None:
        """One-line ``FileNotFoundError`` when any expected file is absent."""
        folder = self.files_folder()
        missing = self.missing_files()
        if not missing:
            return
        found = "no" if len(missing) == len(self.file_names) else f"missing {', '.join(missing)} of the"
        raise FileNotFoundError(f"{self.dataset_name}: {found} {self.files_description} under '{folder}' "
                                f"(expected {self.expected_text}); set download=True or data_dir")


class CIFARPickles(TorchvisionDataModule):
    """CIFAR-10/100 read from their python pickle batches (``train_files``, ``test_files``)."""

    in_chans = 3
    train_files: ClassVar[tuple[str, ...]]
    test_files: ClassVar[tuple[str, ...]]
    label_key: ClassVar[str]

    def prepare_data(self) -> None:
        """Fetch and unpack torchvision's md5-checked archive when a file is missing; unlike
        building torchvision's dataset, this never unpickles the files."""
        if self.download and self.missing_files():
            source = self.torchvision_class
            download_and_extract_archive(source.url, str(self.data_dir), filename=source.filename, md5=source.tgz_md5)

    def load_split(self, train: bool) -> Dataset:
        self.check_files()
        names = self.train_files if train else self.test_files
        return read_cifar_batches([os.path.join(self.files_folder(), n) for n in names], self.label_key)


class CIFAR10(CIFARPickles):
    """CIFAR-10: 50000 train / 10000 test 32x32 RGB images, 10 classes.

    Files: ``data_dir/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}``.
    """

    dataset_name = "CIFAR10"
    torchvision_class = torchvision.datasets.CIFAR10
    num_classes = 10
    class_names = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
    default_mean = CIFAR10_MEAN
    default_std = CIFAR10_STD
    folder_parts = ("cifar-10-batches-py",)
    train_files = tuple(f"data_batch_{i}" for i in range(1, 6))
    test_files = ("test_batch",)
    file_names = train_files + test_files + ("batches.meta",)
    files_description = "CIFAR-10 python batches"
    expected_text = "data_batch_1..5, test_batch and batches.meta"
    label_key = "labels"


class CIFAR100(CIFARPickles):
    """CIFAR-100: 50000 train / 10000 test 32x32 RGB images, 100 fine classes.

    Files: ``data_dir/cifar-100-python/{train, test, meta}``.
    """

    dataset_name = "CIFAR100"
    torchvision_class = torchvision.datasets.CIFAR100
    num_classes = 100
    default_mean = CIFAR100_MEAN
    default_std = CIFAR100_STD
    folder_parts = ("cifar-100-python",)
    train_files = ("train",)
    test_files = ("test",)
    file_names = ("train", "test", "meta")
    files_description = "CIFAR-100 python files"
    expected_text = "train, test and meta"
    label_key = "fine_labels"


class MNIST(TorchvisionDataModule):
    """MNIST: 60000 train / 10000 test 28x28 grey digits, 10 classes; no flip by default.

    Files: ``data_dir/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (uncompressed).
    """

    dataset_name = "MNIST"
    torchvision_class = torchvision.datasets.MNIST
    num_classes = 10
    in_chans = 1
    default_mean = MNIST_MEAN
    default_std = MNIST_STD
    folder_parts = ("MNIST", "raw")
    file_names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                  "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    files_description = "MNIST idx files"
    expected_text = "uncompressed " + ", ".join(file_names)

    def __init__(self, data_dir: str = "data", batch_size: int = 256, eval_batch_size: int | None = None,
                 num_workers: int = 0, image_size: int = 28, download: bool = False,
                 train_augmentation: bool = True, horizontal_flip: bool = False, crop_scale: tuple[float, float] = (0.2, 1.0),
                 eval_crop_ratio: float = 1.0, mean: Sequence[float] | None = None,
                 std: Sequence[float] | None = None, pin_memory: bool = False,
                 drop_last_train: bool = True, persistent_workers: bool = True, rand_augment: str | None = None,
                 random_erasing: float = 0.0) -> None:
        super().__init__(data_dir=data_dir, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         num_workers=num_workers, image_size=image_size, download=download,
                         train_augmentation=train_augmentation, horizontal_flip=horizontal_flip, crop_scale=crop_scale,
                         eval_crop_ratio=eval_crop_ratio, mean=mean, std=std, pin_memory=pin_memory,
                         drop_last_train=drop_last_train, persistent_workers=persistent_workers,
                         rand_augment=rand_augment, random_erasing=random_erasing)

    def load_split(self, train: bool) -> Dataset:
        self.check_files()
        split = torchvision.datasets.MNIST(str(self.data_dir), train=train, download=False)
        return InMemoryImages(split.data.unsqueeze(1), split.targets)
