"""FID, KID and Inception Score of generated samples through torch-fidelity (the decay paper, section 5:
the paper reports FID of 50k samples against the training set).

``input1`` is a :class:`GeneratedImages` dataset that draws the samples batch by batch as
torch-fidelity reads them; ``input2`` is the reference dataset as uint8 images
(:class:`UInt8Images` undoes a datamodule's normalisation), cached by torch-fidelity under
``cache_root`` with ``reference_cache_name``: the reference features and statistics are
extracted once and reused by every later call with the same name.

The feature extractor is any name in torch-fidelity's registry (default
``inception-v3-compat``, whose weights file ``feature_extractor_weights_path`` points to when
it cannot be downloaded). Metrics that the extractor does not provide a feature for (e.g. IS
without logits) are skipped.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

METRIC_KEYS = {
    "frechet_inception_distance": "fid",
    "kernel_inception_distance_mean": "kid_mean",
    "kernel_inception_distance_std": "kid_std",
    "inception_score_mean": "isc_mean",
    "inception_score_std": "isc_std",
}


def to_uint8_rgb(images: torch.Tensor) -> torch.Tensor:
    """``N x C x H x W`` floats in [0, 1] (C in 1, 3) -> uint8 ``N x 3 x H x W`` on the CPU."""
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be N x C x H x W with C in (1, 3), got shape {tuple(images.shape)}")
    images = (images.detach().float().clamp(0.0, 1.0) * 255.0 + 0.5).to(torch.uint8).cpu()
    return images.expand(-1, 3, -1, -1).contiguous() if images.shape[1] == 1 else images


class GeneratedImages(Dataset):
    """``num_samples`` uint8 ``3 x H x W`` images made by ``generate(batch_index, size)``.

    ``generate`` returns ``size`` images in [0, 1] (``size x C x H x W``); batches are made
    when first read and only the latest one is kept, so torch-fidelity's in-order reading
    holds one batch in memory.
    """

    def __init__(self, generate: Callable[[int, int], torch.Tensor], num_samples: int, batch_size: int) -> None:
        if num_samples <= 0 or batch_size <= 0:
            raise ValueError(f"num_samples and batch_size must be > 0, got {num_samples} and {batch_size}")
        self.generate = generate
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.batches_made = 0
        self._batch_index: Optional[int] = None
        self._batch: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_samples:
            raise IndexError(index)
        batch_index, offset = divmod(index, self.batch_size)
        if batch_index != self._batch_index:
            size = min(self.batch_size, self.num_samples - batch_index * self.batch_size)
            self._batch = to_uint8_rgb(self.generate(batch_index, size))
            self._batch_index = batch_index
            self.batches_made += 1
        return self._batch[offset]


class UInt8Images(Dataset):
    """uint8 ``3 x H x W`` images of ``(normalised image, label)`` samples: ``x * std + mean``.

    ``indices`` picks a subset (in that order).
    """

    def __init__(self, samples: Dataset, mean: Sequence[float], std: Sequence[float],
                 indices: Optional[Sequence[int]] = None) -> None:
        self.samples = samples
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.indices = list(range(len(samples))) if indices is None else list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> torch.Tensor:
        image = self.samples[self.indices[index]][0]
        image = torch.as_tensor(image)
        if image.dtype != torch.uint8:
            image = image.float() * self.std + self.mean
        else:
            image = image.float() / 255.0
        return to_uint8_rgb(image.unsqueeze(0))[0]


def subset_indices(total: int, num: Optional[int], seed: int = 0) -> Optional[list[int]]:
    """A fixed random subset of ``num`` of ``total`` indices (sorted); ``None`` = all."""
    if num is None or num >= total:
        return None
    if num <= 0:
        raise ValueError(f"num_reference must be > 0 or null, got {num}")
    return sorted(np.random.default_rng(seed).choice(total, size=num, replace=False).tolist())


def extractor_provides(feature_extractor: str, metric: str) -> bool:
    """Whether the registered extractor has a default feature layer for ``metric``."""
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

    cls = FEATURE_EXTRACTORS_REGISTRY.get(feature_extractor)
    if cls is None:
        raise ValueError(f"feature_extractor: {feature_extractor!r} is not registered with torch-fidelity; "
                         f"registered: {', '.join(sorted(FEATURE_EXTRACTORS_REGISTRY))}")
    try:
        layer = cls.get_default_feature_layer_for_metric(metric)
    except (NotImplementedError, KeyError, ValueError, AssertionError):
        return False
    return layer is not None and layer in cls.get_provided_features_list()


def generation_metrics(
    generated: Dataset,
    reference: Dataset,
    reference_cache_name: str,
    cache_root: str | os.PathLike,
    feature_extractor: str = "inception-v3-compat",
    feature_extractor_weights_path: Optional[str] = None,
    fid: bool = True,
    kid: bool = True,
    isc: bool = True,
    kid_subset_size: int = 1000,
    batch_size: int = 64,
    cuda: bool = False,
    verbose: bool = False,
) -> dict[str, float]:
    """``torch_fidelity.calculate_metrics(input1=generated, input2=reference)`` with the
    reference cached as ``reference_cache_name`` under ``cache_root``.

    Returns ``fid``, ``kid_mean``/``kid_std`` and ``isc_mean``/``isc_std`` (those asked for and
    provided by the extractor).
    """
    import torch_fidelity

    if not reference_cache_name or os.sep in reference_cache_name:
        raise ValueError(f"reference_cache_name must be a non-empty file name, got {reference_cache_name!r}")
    kid = kid and extractor_provides(feature_extractor, "kid")
    isc = isc and extractor_provides(feature_extractor, "isc")
    fid = fid and extractor_provides(feature_extractor, "fid")
    if not (fid or kid or isc):
        raise ValueError(f"feature_extractor: {feature_extractor!r} provides none of the metrics asked for")
    os.makedirs(cache_root, exist_ok=True)
    kwargs = dict(
        input1=generated, input2=reference if (fid or kid) else None, input2_cache_name=reference_cache_name,
        cache=True, cache_root=os.fspath(cache_root), fid=fid, kid=kid, isc=isc,
        feature_extractor=feature_extractor, batch_size=batch_size, cuda=cuda, verbose=verbose,
        save_cpu_ram=True,  # no loader worker processes: the generated set lives on the model's device
    )
    if feature_extractor_weights_path is not None:
        kwargs["feature_extractor_weights_path"] = os.fspath(feature_extractor_weights_path)
    if kid:
        kwargs["kid_subset_size"] = min(kid_subset_size, len(generated), len(reference))
    if isc:
        kwargs["isc_splits"] = max(1, min(10, len(generated) // 2))
    raw = torch_fidelity.calculate_metrics(**kwargs)
    return {METRIC_KEYS.get(k, k): float(v) for k, v in raw.items()}
