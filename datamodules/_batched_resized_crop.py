"""Resized crops of a whole batch of images of different sizes in a few calls: antialiased bicubic,
the weights of ``torch.nn.functional.interpolate(mode="bicubic", antialias=True)``.

That resampling is separable: the crop ``(top, left, height, width)`` of an image resized to
``size x size`` is ``Ry @ image @ Rx^T``, where ``Ry`` (``size x H``) holds, for each output row,
the normalised bicubic (Keys, a = -0.5) weights of the input rows inside the crop, the kernel
stretched by the downscale factor (the antialias), and ``Rx`` likewise for the columns. The
matrices of every image are built at once from the boxes (a few elementwise calls over ``B x
size x H``), the images are padded to one ``B x 3 x H x W`` tensor (their padding has weight 0),
and two batched matmuls resize the batch: no Python loop over the images, one launch count
whatever the batch. ``torch.nn.functional.interpolate`` takes the same weights on each crop
(``_compute_indices_min_size_weights_aa`` in ATen's ``UpSample.h``); the results agree within
float rounding (tested).
"""
from __future__ import annotations

import torch

BICUBIC_A = -0.5  # Keys' kernel, as ATen's antialiased bicubic
SUPPORT = 2.0  # the kernel's half-width in input pixels at scale 1


def bicubic(t: torch.Tensor) -> torch.Tensor:
    """Keys' cubic convolution kernel (a = -0.5) at ``t``."""
    t = t.abs()
    a = BICUBIC_A
    near = ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0
    far = (((t - 5.0) * t + 8.0) * t - 4.0) * a
    return torch.where(t < 1.0, near, torch.where(t < 2.0, far, torch.zeros_like(t)))


def resampling_matrices(starts: torch.Tensor, lengths: torch.Tensor, full: int, size: int) -> torch.Tensor:
    """``B x size x full``: row ``i`` of image ``b`` weighs the input positions ``0 .. full - 1``
    for output ``i`` of the crop ``[starts[b], starts[b] + lengths[b])`` resized to ``size``."""
    dtype = torch.float32
    lengths = lengths.to(dtype).view(-1, 1, 1)
    scale = lengths / size  # input pixels per output pixel
    support = torch.where(scale >= 1.0, SUPPORT * scale, torch.full_like(scale, SUPPORT))
    invscale = torch.where(scale >= 1.0, 1.0 / scale, torch.ones_like(scale))
    center = scale * (torch.arange(size, device=starts.device, dtype=dtype).view(1, -1, 1) + 0.5)
    first = torch.clamp(torch.trunc(center - support + 0.5), min=0.0)  # as ATen: int() of the window's ends
    last = torch.minimum(torch.trunc(center + support + 0.5), lengths)
    position = torch.arange(full, device=starts.device, dtype=dtype).view(1, 1, -1) - starts.to(dtype).view(-1, 1, 1)
    weights = bicubic((position - center + 0.5) * invscale) * ((position >= first) & (position < last))
    total = weights.sum(-1, keepdim=True)
    return weights / torch.where(total == 0, torch.ones_like(total), total)


def pad_images(images: list[torch.Tensor]) -> torch.Tensor:
    """``C x H_i x W_i`` images (one device, one dtype) as one zero-padded ``B x C x H x W`` tensor,
    in two calls."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided nested layout is marked prototype; this is all it does
        return torch.nested.as_nested_tensor(images).to_padded_tensor(0)


def resized_crops(images: torch.Tensor, boxes: torch.Tensor, size: int) -> torch.Tensor:
    """``B x C x size x size`` float32: the crops ``boxes`` (``B x 4`` ``top, left, height, width``)
    of the padded ``images`` (``B x C x H x W``), antialiased bicubic."""
    boxes = boxes.to(images.device)
    rows = resampling_matrices(boxes[:, 0], boxes[:, 2], images.shape[-2], size)  # B x size x H
    columns = resampling_matrices(boxes[:, 1], boxes[:, 3], images.shape[-1], size)  # B x size x W
    pixels = images.float()
    across = torch.matmul(pixels, columns.transpose(1, 2).unsqueeze(1))  # B x C x H x size: the columns first
    return torch.matmul(rows.unsqueeze(1), across)  # B x C x size x size
