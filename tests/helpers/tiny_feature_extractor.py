"""A tiny torch-fidelity feature extractor with fixed random weights, registered under
``TINY_EXTRACTOR`` so the FID/KID/IS pipeline runs in tests without Inception weights.

Features: ``pool`` (16-d, for FID and KID) and ``logits_unbiased`` (10-d, for IS), computed
from the uint8 images as torch-fidelity hands them over.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch_fidelity.feature_extractor_base import FeatureExtractorBase
from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

TINY_EXTRACTOR = "shortcutlab-tiny-test"
FEATURES = ("pool", "logits_unbiased")


class TinyFeatureExtractor(FeatureExtractorBase):
    def __init__(self, name: str, features_list: list[str], **kwargs) -> None:
        super().__init__(name, features_list)
        generator = torch.Generator().manual_seed(0)
        self.register_buffer("conv", torch.randn(16, 3, 3, 3, generator=generator) / 3.0)
        self.register_buffer("linear", torch.randn(10, 16, generator=generator))

    @staticmethod
    def get_provided_features_list() -> tuple[str, ...]:
        return FEATURES

    @staticmethod
    def get_default_feature_layer_for_metric(metric: str) -> str:
        return {"fid": "pool", "kid": "pool", "isc": "logits_unbiased"}[metric]

    @staticmethod
    def can_be_compiled() -> bool:
        return False

    @staticmethod
    def get_dummy_input_for_compile() -> torch.Tensor:
        return torch.zeros(1, 3, 16, 16, dtype=torch.uint8)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = images.float() / 127.5 - 1.0
        pool = F.conv2d(x, self.conv, padding=1).relu().mean(dim=(2, 3)) * 4.0
        out = {"pool": pool.double(), "logits_unbiased": pool @ self.linear.t()}
        return tuple(out[name] for name in self.features_list)


def register_tiny_extractor() -> str:
    """Register once per process; returns the name."""
    if TINY_EXTRACTOR not in FEATURE_EXTRACTORS_REGISTRY:
        register_feature_extractor(TINY_EXTRACTOR, TinyFeatureExtractor)
    return TINY_EXTRACTOR


class IsOnlyExtractor(TinyFeatureExtractor):
    """Provides only logits: FID and KID are not available with it."""

    @staticmethod
    def get_provided_features_list() -> tuple[str, ...]:
        return ("logits_unbiased",)

    @staticmethod
    def get_default_feature_layer_for_metric(metric: str) -> str:
        if metric != "isc":
            raise NotImplementedError(metric)
        return "logits_unbiased"
