"""An image file's bytes as a converted dataset stores them (``shortcutlab chunks``), read by the
same decoders as a file on disk: every loader of :mod:`datamodules.imagenet` takes a path or a
:class:`StoredImage`; an image none of them can read is a :class:`CorruptImageError`, which
:func:`first_readable` turns into a warning and the next readable image when asked to."""
from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Union

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


class CorruptImageError(ValueError):
    """An image file that PIL cannot decode; the message names the file (one line)."""


def first_readable(read: Callable[[int], Any], index: int, count: int, skip_corrupt: bool, where: str) -> Any:
    """``read(index)``; with ``skip_corrupt`` an unreadable image is replaced, with a warning, by the
    next readable one (so batch sizes and epoch length stay the same)."""
    for offset in range(count):
        try:
            return read((index + offset) % count)
        except CorruptImageError as err:
            if not skip_corrupt:
                raise
            warnings.warn(f"{str(err).split('; set data')[0]}; skipped, using the next readable image", stacklevel=3)
    raise CorruptImageError(f"ImageNet: no readable image under '{where}'")
