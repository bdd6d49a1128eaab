"""JPEG decoding and the MAE train augmentation on the accelerator (the decay paper, section 4, data).

The CPU path decodes every image and crops it in a loader worker: at a ViT-B/16 step rate that
needs more cores than a GPU host has. Here the workers only read each file and draw the
augmentation (RandomResizedCrop's box from the image size in the JPEG header, nothing decoded,
and the flip); the batch goes to the device as encoded bytes, where ``torchvision.io.decode_jpeg``
decodes the whole batch at once (nvJPEG on CUDA), and the batch is cropped and resized to
``image_size`` (bicubic, antialiased: two batched matmuls, :mod:`datamodules._batched_resized_crop`),
flipped and normalised there. The idea is timm's
prefetcher's (uint8 over the bus, normalised on the device), with the decoding moved too.

The crop box comes from the same ``RandomResizedCrop.get_params`` the CPU transform draws from,
and the resized pixels are rounded to whole levels as the CPU path's uint8 result is: given the
same box and flip, the two agree within resampling rounding (tested). A file nvJPEG cannot read
(not a JPEG, or CMYK) is decoded in the worker instead and travels as pixels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from PIL import Image
from torchvision import transforms
from torchvision.io import ImageReadMode, decode_jpeg

from datamodules._batched_resized_crop import pad_images, resized_crops
from datamodules._stored_image import ImageSource, image_bytes, open_image

GPU_DECODABLE_MODES = ("RGB", "L")  # JPEG colour modes nvJPEG decodes to RGB


@dataclass
class EncodedImages:
    """A batch as the workers hand it over, in few tensors (one shared-memory handle each between
    processes, not one per image): ``payload`` holds each image's JPEG bytes, or for a file the
    device cannot decode its ``3 x H x W`` uint8 pixels, at ``offsets[i]:offsets[i + 1]``;
    ``shapes[i]`` is ``(3, H, W)`` for such pixels and zeros for a JPEG; ``boxes`` the crop boxes
    ``(top, left, height, width)`` (``B x 4`` int64), ``flips`` a ``B`` bool tensor."""

    payload: torch.Tensor
    offsets: torch.Tensor
    shapes: torch.Tensor
    boxes: torch.Tensor
    flips: torch.Tensor

    def __len__(self) -> int:
        return len(self.boxes)

    @classmethod
    def of(cls, data: Sequence[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor) -> "EncodedImages":
        """From per-image JPEG bytes (1-D) or pixels (``3 x H x W``)."""
        sizes = torch.tensor([0] + [item.numel() for item in data], dtype=torch.int64)
        shapes = torch.tensor([list(item.shape) if item.ndim == 3 else [0, 0, 0] for item in data], dtype=torch.int64)
        payload = torch.cat([item.reshape(-1) for item in data]) if data else torch.empty(0, dtype=torch.uint8)
        return cls(payload, sizes.cumsum(0), shapes.view(-1, 3), boxes, flips)

    def item(self, index: int) -> torch.Tensor:
        """Image ``index``: its JPEG bytes or its ``3 x H x W`` pixels (a view of the payload)."""
        start, end = self.offsets[index].item(), self.offsets[index + 1].item()
        flat = self.payload[start:end]
        shape = self.shapes[index].tolist()
        return flat.view(shape) if shape[0] else flat


class EncodedCrop:
    """The loader of one training image (a file, or a conversion's stored bytes): its bytes and the augmentation drawn
    for it, ``(data, box, flip)``; decoding is left to :func:`decode_and_augment`. ``read_pixels``
    decodes a file the device cannot (``3 x H x W`` uint8) and raises the dataset's one-line error
    for a file nothing can read."""

    def __init__(self, scale: Sequence[float], horizontal_flip: bool, read_pixels: Callable[[ImageSource], torch.Tensor],
                 ratio: Sequence[float] = (3 / 4, 4 / 3)) -> None:
        self.scale, self.ratio, self.horizontal_flip = list(scale), list(ratio), horizontal_flip
        self.read_pixels = read_pixels

    def __call__(self, path: ImageSource) -> tuple[torch.Tensor, torch.Tensor, bool]:
        try:
            with open_image(path) as f, Image.open(f) as header:  # the size and mode only: nothing decoded
                size, decodable = header.size, header.format == "JPEG" and header.mode in GPU_DECODABLE_MODES
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
            self.read_pixels(path)  # raises the dataset's one-line error naming the file
            raise
        data = image_bytes(path) if decodable else self.read_pixels(path)
        width, height = size
        shape_only = torch.empty(1, 1, 1).expand(1, height, width)  # get_params reads the size alone
        box = transforms.RandomResizedCrop.get_params(shape_only, self.scale, self.ratio)
        flip = self.horizontal_flip and bool(torch.rand(1) < 0.5)
        return data, torch.tensor(box, dtype=torch.int64), flip


def collate_encoded(samples: list[tuple[tuple[torch.Tensor, torch.Tensor, bool], int]]) -> tuple[EncodedImages, torch.Tensor]:
    """``[((data, box, flip), label), ...]`` -> ``(EncodedImages, labels)``."""
    data = [sample[0][0] for sample in samples]
    boxes = torch.stack([sample[0][1] for sample in samples])
    flips = torch.tensor([sample[0][2] for sample in samples], dtype=torch.bool)
    labels = torch.tensor([int(sample[1]) for sample in samples], dtype=torch.int64)
    return EncodedImages.of(data, boxes, flips), labels


PADDED_PIXELS = 1 << 25  # per resize call: crops padded to one tensor of at most this many pixels a channel


def decode_and_augment(images: EncodedImages, device: torch.device, image_size: int, mean: Sequence[float],
                       std: Sequence[float]) -> torch.Tensor:
    """The ``B x 3 x image_size x image_size`` float32 batch on ``device``: decoded (the JPEGs in one
    call), cropped and resized (bicubic, antialiased, rounded to whole levels) as one batch
    (:mod:`datamodules._batched_resized_crop`), flipped, normalised."""
    device = torch.device(device)
    offsets, shapes = images.offsets.tolist(), images.shapes.tolist()  # host tensors: no synchronisation
    items = [images.payload[offsets[i]:offsets[i + 1]] for i in range(len(images))]
    jpegs = [i for i, shape in enumerate(shapes) if not shape[0]]
    decoded = dict(zip(jpegs, decode_jpeg([items[i] for i in jpegs], mode=ImageReadMode.RGB,
                                          device=device))) if jpegs else {}
    boxes = images.boxes.tolist()
    crops = []
    for i, (top, left, height, width) in enumerate(boxes):
        image = decoded[i] if i in decoded else items[i].view(shapes[i]).to(device, non_blocking=True)
        crops.append(image[:, top:top + height, left:left + width])
    out = torch.empty(len(images), 3, image_size, image_size, device=device)
    whole = torch.tensor([[0, 0, h, w] for _, _, h, w in boxes], dtype=torch.int64)
    for chunk in padded_chunks(boxes):
        index = torch.tensor(chunk, dtype=torch.int64)
        resized = resized_crops(pad_images([crops[i] for i in chunk]), whole[index], image_size)
        out.index_copy_(0, index.to(device, non_blocking=True), resized)
    out = out.round_().clamp_(0, 255)
    flips = images.flips.to(device, non_blocking=True).view(-1, 1, 1, 1)
    out = torch.where(flips, out.flip(-1), out)
    mean_ = torch.tensor(mean, device=device).view(1, -1, 1, 1) * 255
    std_ = torch.tensor(std, device=device).view(1, -1, 1, 1) * 255
    return (out - mean_) / std_


def padded_chunks(boxes: list[list[int]], budget: int = PADDED_PIXELS) -> list[list[int]]:
    """The images' indices in groups whose crops, padded to the group's largest height and width,
    hold at most ``budget`` pixels a channel (one group for a batch of ImageNet-sized crops; an
    outsized photo gets fewer companions, not a huge padded tensor), smaller crops first."""
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][2] * boxes[i][3])
    chunks: list[list[int]] = []
    height = width = 0
    for i in order:
        h, w = max(height, boxes[i][2]), max(width, boxes[i][3])
        if chunks and (len(chunks[-1]) + 1) * h * w <= budget:
            chunks[-1].append(i)
            height, width = h, w
        else:
            chunks.append([i])
            height, width = boxes[i][2], boxes[i][3]
    return chunks


def transfer_encoded(batch: Any, device: torch.device, image_size: int, mean: Sequence[float],
                     std: Sequence[float]) -> Any:
    """``(EncodedImages, labels)`` decoded and augmented on ``device``; any other batch: None."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and isinstance(batch[0], EncodedImages):
        return decode_and_augment(batch[0], device, image_size, mean, std), batch[1].to(device, non_blocking=True)
    return None
