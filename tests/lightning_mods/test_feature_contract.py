"""The feature contract in code: every family's LightningModule is a ``FeatureModule``, its
``forward_intermediates`` reads ``indices`` as timm does and returns the same block features as
the full call, and a module without it gets a one-line error naming what is missing."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mods.backbone.resnet import ResNet18Cifar
from lightning_mods.classifier import ImageClassifier
from lightning_mods.diffusion import DiffusionModule
from lightning_mods.evaluation.feature_contract import FeatureModule, require_blocks, take_indices
from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.backbone.residual_mlp import ResidualMLP
from lightning_mods.spiral_classifier import SpiralClassifier
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.backbone.uvit import UViT


def families() -> dict[str, tuple[nn.Module, torch.Tensor, int]]:
    """name -> (a small module, an input batch, its number of blocks)."""
    torch.manual_seed(0)
    return {
        "mae": (MaskedAutoencoder(MaskedAutoencoderViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=4, num_heads=2, decoder_embed_dim=8, decoder_depth=1, decoder_num_heads=2)),
                torch.randn(3, 1, 8, 8), 4),
        "classifier": (ImageClassifier(ResNet18Cifar(), num_classes=4, in_chans=1), torch.randn(3, 1, 16, 16), 8),
        "diffusion": (DiffusionModule(UViT(img_size=8, in_chans=1, patch_size=2, embed_dim=16, depth=3, num_heads=2, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}), pixel_mean=[0.5], pixel_std=[0.5], num_sampling_steps=4),
                      torch.randn(3, 1, 8, 8), 3),
        "spiral": (SpiralClassifier(ResidualMLP(depth=4, width=6)), torch.randn(3, 2), 4),
    }


@pytest.mark.parametrize("name", ["mae", "classifier", "diffusion", "spiral"])
def test_every_family_meets_the_contract(name):
    module, x, num_blocks = families()[name]
    module.eval()
    assert isinstance(module, FeatureModule)
    with torch.no_grad():
        features, blocks = module.forward_intermediates(x)
        assert len(blocks) == num_blocks and all(b.ndim == 2 and len(b) == len(x) for b in blocks)
        assert features.shape == (len(x), module.num_features)
        torch.testing.assert_close(features, module.forward_features(x))
        picked = module.forward_intermediates(x, [0, -1], intermediates_only=True)
        torch.testing.assert_close(picked, [blocks[0], blocks[-1]])
        last_two = module.forward_intermediates(x, 2, intermediates_only=True)
        torch.testing.assert_close(last_two, blocks[-2:])


def test_indices_are_read_as_timm_reads_them():
    """Hand-computed: None every block, n the last n, a list 0-based with negatives from the end."""
    assert take_indices(5, None) == [0, 1, 2, 3, 4]
    assert take_indices(5, 2) == [3, 4]
    assert take_indices(5, [0, -1]) == [0, 4]
    assert take_indices(5, [-2, 1]) == [3, 1]


def test_a_module_without_block_features_gets_one_line():
    class FeaturesOnly(nn.Module):
        num_features = 4

        def forward_features(self, x):  # noqa: ANN001
            return x

    with pytest.raises(ValueError, match=r"KNNEvaluator: blocks needs FeaturesOnly\.forward_intermediates") as caught:
        require_blocks(FeaturesOnly(), "KNNEvaluator: blocks")
    assert "\n" not in str(caught.value)
