"""An image file's bytes as a converted dataset stores them (``shortcutlab shards``), read by the
same decoders as a file on disk: every loader of :mod:`datamodules.imagenet` takes a path or a
:class:`StoredImage`."""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import BinaryIO, Union

import torch
from torchvision.io import read_file


@dataclass(frozen=True)
class StoredImage:
    """The bytes of one image file, kept as they were (no re-encoding), and the name errors give it
    (the conversion, the sample's index and the file it came from)."""

    name: str
    data: bytes


ImageSource = Union[str, StoredImage]


def open_image(source: ImageSource) -> BinaryIO:
    """A binary file object of the image's encoded bytes."""
    return io.BytesIO(source.data) if isinstance(source, StoredImage) else open(source, "rb")


def image_bytes(source: ImageSource) -> torch.Tensor:
    """The image's encoded bytes as a 1-D uint8 tensor (what ``torchvision.io.decode_*`` reads)."""
    if isinstance(source, StoredImage):
        return torch.frombuffer(bytearray(source.data), dtype=torch.uint8)
    return read_file(source)


def image_name(source: ImageSource) -> str:
    return source.name if isinstance(source, StoredImage) else str(source)


def is_empty(source: ImageSource) -> bool:
    if isinstance(source, StoredImage):
        return not source.data
    return not os.path.exists(source) or os.path.getsize(source) == 0
