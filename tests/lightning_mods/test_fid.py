"""FID/KID/IS through torch-fidelity with a registered tiny extractor (the decay paper, section 5): the real
pipeline (sample generation, uint8 conversion, statistics, reference caching) without downloads."""
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

from lightning_mods._generation.fidelity_metrics import (GeneratedImages, UInt8Images, extractor_provides, generation_metrics,
                                to_uint8_rgb)
from helpers.tiny_feature_extractor import IsOnlyExtractor, register_tiny_extractor

TINY_EXTRACTOR = register_tiny_extractor()
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_diffusion_quick.yaml"


class CountingImages(Dataset):
    """uint8 images made from [0, 1] floats exactly as the generated ones; counts reads."""

    def __init__(self, images01: torch.Tensor) -> None:
        self.images = to_uint8_rgb(images01)
        self.reads = 0

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        self.reads += 1
        return self.images[index]


def images01(n: int = 160, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def generated_from(images: torch.Tensor, batch_size: int = 40) -> GeneratedImages:
    return GeneratedImages(lambda b, n: images[b * batch_size: b * batch_size + n], len(images), batch_size)


def test_generated_images_are_made_batch_by_batch_as_uint8_rgb():
    calls = []

    def generate(batch_index, size):
        calls.append((batch_index, size))
        return torch.full((size, 1, 4, 4), batch_index / 10.0)

    data = GeneratedImages(generate, num_samples=10, batch_size=4)
    items = [data[i] for i in range(10)]
    assert calls == [(0, 4), (1, 4), (2, 2)] and data.batches_made == 3
    assert items[0].dtype == torch.uint8 and items[0].shape == (3, 4, 4)
    assert items[9].unique().tolist() == [round(0.2 * 255)]
    with pytest.raises(IndexError):
        data[10]


def test_uint8_reference_undoes_the_normalisation():
    pixels = torch.rand(3, 1, 4, 4)
    samples = [((p - 0.3) / 0.2, 0) for p in pixels]
    data = UInt8Images(samples, [0.3], [0.2], indices=[2, 0])
    assert len(data) == 2
    expected = (pixels[2] * 255 + 0.5).to(torch.uint8).expand(3, -1, -1)
    assert (data[0].int() - expected.int()).abs().max() <= 1  # float round-off at .5 boundaries


def test_fid_of_a_set_against_itself_is_zero_and_a_shifted_set_is_far(tmp_path):
    real = images01()
    same = generation_metrics(generated_from(real), CountingImages(real), "real", tmp_path,
                              feature_extractor=TINY_EXTRACTOR, kid_subset_size=100)
    shifted = generation_metrics(generated_from(real * 0.6 + 0.3), CountingImages(real), "real", tmp_path,
                                 feature_extractor=TINY_EXTRACTOR, kid_subset_size=100)
    assert set(same) == {"fid", "kid_mean", "kid_std", "isc_mean", "isc_std"}
    assert abs(same["fid"]) < 1e-6 and abs(same["kid_mean"]) < 1e-2
    assert shifted["fid"] > 0.5 and shifted["fid"] > 1e4 * max(abs(same["fid"]), 1e-9)
    assert shifted["kid_mean"] > 0.1


@pytest.mark.parametrize("metrics", [dict(kid=False, isc=False), dict(kid=True, isc=True)])
def test_reference_statistics_are_cached_and_reused(tmp_path, metrics):
    real = images01(seed=1)
    first_reference = CountingImages(real)
    first = generation_metrics(generated_from(images01(seed=2)), first_reference, "digits-ref", tmp_path,
                               feature_extractor=TINY_EXTRACTOR, kid_subset_size=100, **metrics)
    assert first_reference.reads >= len(real)
    cached = sorted(p.name for p in tmp_path.iterdir())
    assert f"digits-ref-{TINY_EXTRACTOR}-stat-fid-pool.pt" in cached
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    second_reference = CountingImages(real)
    second = generation_metrics(generated_from(images01(seed=2)), second_reference, "digits-ref", tmp_path,
                                feature_extractor=TINY_EXTRACTOR, kid_subset_size=100, **metrics)
    assert second_reference.reads == 0  # never extracted again
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps
    assert second["fid"] == pytest.approx(first["fid"], rel=1e-9)


def test_metrics_the_extractor_lacks_are_skipped(tmp_path):
    name = "shortcutlab-tiny-test-is-only"
    if name not in FEATURE_EXTRACTORS_REGISTRY:
        register_feature_extractor(name, IsOnlyExtractor)
    assert extractor_provides(name, "isc") and not extractor_provides(name, "fid")
    out = generation_metrics(generated_from(images01(40)), CountingImages(images01(40)), "ref", tmp_path,
                             feature_extractor=name)
    assert set(out) == {"isc_mean", "isc_std"}
    with pytest.raises(ValueError, match="feature_extractor"):
        generation_metrics(generated_from(images01(40)), CountingImages(images01(40)), "ref", tmp_path,
                           feature_extractor=name, isc=False)
    with pytest.raises(ValueError, match="feature_extractor"):
        extractor_provides("no-such-extractor", "fid")
