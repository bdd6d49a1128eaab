"""datamodules/_batched_resized_crop.py: a batch of crops of images of different sizes, resized in two
batched matmuls, equals torch's antialiased bicubic ``interpolate`` of each crop alone (down- and
upscaling) within float rounding; the kernel is Keys' a = -0.5 at hand-computed points; the
padding the batch adds never weighs in; large crops are split off into their own calls."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from datamodules._batched_resized_crop import bicubic, pad_images, resized_crops
from datamodules._gpu_decode import padded_chunks


def test_keys_kernel_at_hand_computed_points():
    t = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, -0.5, 2.5])
    # a = -0.5: 1.5|t|^3 - 2.5|t|^2 + 1 below 1, -0.5|t|^3 + 2.5|t|^2 - 4|t| + 2 below 2, 0 beyond
    assert bicubic(t).tolist() == pytest.approx([1.0, 0.5625, 0.0, -0.0625, 0.0, 0.5625, 0.0])


@pytest.mark.parametrize("size", [224, 24])
def test_each_crop_equals_torchs_antialiased_bicubic_interpolate(size):
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
              for h, w in [(375, 500), (500, 333), (64, 80), (100, 90)]]
    boxes = torch.tensor([[10, 20, 200, 150], [0, 0, 500, 333], [5, 7, 40, 30], [0, 0, 100, 90]])
    got = resized_crops(pad_images(images), boxes, size)
    assert got.shape == (4, 3, size, size)
    for image, crop, (top, left, height, width) in zip(images, got, boxes.tolist()):
        expected = F.interpolate(image[:, top:top + height, left:left + width].unsqueeze(0).float(),
                                 size=(size, size), mode="bicubic", antialias=True, align_corners=False)[0]
        torch.testing.assert_close(crop, expected, rtol=0, atol=1e-3)


def test_the_padding_never_weighs_in():
    image = torch.full((1, 20, 30), 200, dtype=torch.uint8)
    tall = torch.zeros(1, 60, 10, dtype=torch.uint8)  # pads the first image to 60 x 30 with zeros
    got = resized_crops(pad_images([image, tall]), torch.tensor([[0, 0, 20, 30], [0, 0, 60, 10]]), 8)
    torch.testing.assert_close(got[0], torch.full((1, 8, 8), 200.0), rtol=0, atol=1e-3)


def test_crops_are_grouped_under_the_padding_budget_smallest_first():
    boxes = [[0, 0, 100, 100], [0, 0, 4000, 3000], [0, 0, 50, 60], [0, 0, 100, 90]]
    assert padded_chunks(boxes, budget=3 * 100 * 100) == [[2, 3, 0], [1]]
    assert padded_chunks(boxes, budget=10 ** 9) == [[2, 3, 0, 1]]
