"""The registered networks keep timm's model contract, as the installed timm release's own
``tests/test_models.py`` writes it (forward, backward, ``default_cfgs``, ``features_only``,
``forward_intermediates`` and its getter, FX forward and backward; TorchScript is not supported),
here on small instances: the references are timm's own ``vit_tiny_patch16_224`` and ``resnet50``
configs, hand-computed feature-map sizes and the eager network itself under FX.

``make timm-tests`` runs timm's own test file on the full-size registered networks."""
from __future__ import annotations

import pytest
import timm
import torch
from timm.layers import _fx
from timm.models import get_pretrained_cfg

import lightning_mods.backbone  # noqa: F401 (registers the networks)
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT

# small instances of every registered encoder; the ResNet-50s keep their stages (timm's layout)
ENCODERS = {
    "vit_tiny_patch16_224_decayed": dict(depth=2, img_size=32, patch_size=8),
    "vit_base_patch16_224_decayed": dict(depth=2, img_size=32, patch_size=8, embed_dim=48, num_heads=2),
    "resnet18_cifar_decayed": dict(),
    "resnet50_decayed": dict(),
    "resnet50d_decayed": dict(),
}
WHOLE_NETWORKS = {
    "mae_vit_tiny_patch4_32_decayed": dict(depth=2, decoder_depth=1, embed_dim=32, num_heads=2, decoder_embed_dim=32,
                                           decoder_num_heads=2),
    "uvit_small_patch2_32_decayed": dict(depth=2, embed_dim=32, num_heads=2, img_size=8),
}


def small(name: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    registered = {**ENCODERS, **WHOLE_NETWORKS}
    return timm.create_model(name, **{**registered[name], **kwargs})


def input_size(model: torch.nn.Module, name: str) -> tuple[int, int, int]:
    """The ViTs' own fixed size, the CIFAR ResNet's 32 pixels, 64 for the ImageNet ResNets (as
    timm's tests shrink inputs)."""
    if name.startswith("vit"):
        return (3, *model.patch_embed.img_size)
    return model.pretrained_cfg["input_size"] if name.startswith("resnet18_cifar") else (3, 64, 64)


@pytest.mark.parametrize("name,reference", [("vit_tiny_patch16_224_decayed", "vit_tiny_patch16_224"),
                                            ("resnet50_decayed", "resnet50"), ("resnet50d_decayed", "resnet50d")])
def test_the_configs_say_what_timm_s_own_say(name, reference):
    ours, theirs = get_pretrained_cfg(name).to_dict(), get_pretrained_cfg(reference).to_dict()
    for key in ("input_size", "fixed_input_size", "pool_size", "first_conv", "classifier", "num_classes"):
        assert ours[key] == theirs[key], key


def test_the_cifar_resnet_s_config_and_feature_info_match_its_stem():
    """A 3x3 stride-1 stem and no max-pool: 32 pixels end at 4x4, stages at reductions 1, 1, 2, 4, 8."""
    model = small("resnet18_cifar_decayed", features_only=True).eval()
    assert model.feature_info.reduction() == [1, 1, 2, 4, 8]
    assert [o.shape[-1] for o in model(torch.randn(1, 3, 32, 32))] == [32, 32, 16, 8, 4]
    assert get_pretrained_cfg("resnet18_cifar_decayed").pool_size == (4, 4)


@pytest.mark.parametrize("name", list(ENCODERS))
def test_forward_features_head_and_classifier_reset(name):
    model = small(name).eval()
    size = input_size(model, name)
    x = torch.randn(2, *size)
    with torch.no_grad():
        features = model.forward_features(x)
        logits = model(x)
        assert logits.shape == (2, model.pretrained_cfg["num_classes"])
        torch.testing.assert_close(model.forward_head(features), logits, rtol=0, atol=0)
        if name.startswith("resnet"):  # the spatial map the config states (at its own input size)
            pool = model.pretrained_cfg["pool_size"]
            at_cfg = model.forward_features(torch.randn(1, *model.pretrained_cfg["input_size"]))
            assert at_cfg.shape[-2:] == pool and at_cfg.shape[1] == model.num_features
        pre = model.forward_head(features, pre_logits=True)
        model.reset_classifier(0)
        assert model(x).shape == pre.shape == (2, model.head_hidden_size)


@pytest.mark.parametrize("name", list(ENCODERS))
def test_backward_reaches_every_parameter(name):
    model = small(name, num_classes=42).train()
    out = model(torch.randn(2, *input_size(model, name)))
    assert out.shape == (2, 42)
    out.mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("name", list(ENCODERS))
def test_features_only_and_forward_intermediates_agree(name):
    model = small(name).eval()
    size = input_size(model, name)
    x = torch.randn(1, *size)
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x), rtol=1e-5, atol=1e-6)
        wanted = model.feature_info if isinstance(model.feature_info, list) else []
        assert len(intermediates) == len(wanted)
        for info, out in zip(wanted, intermediates):  # NCHW maps at the stated reduction and width
            assert out.shape[1] == info["num_chs"]
            assert out.shape[-1] == -(-size[-1] // info["reduction"])
        getter = small(name, features_only=True, feature_cls="getter", out_indices=len(intermediates)).eval()
        got = getter(x)
        assert len(got) == len(intermediates)
        for out, want in zip(got, intermediates):
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def fx_extractor(model: torch.nn.Module, train: bool) -> torch.nn.Module:
    """torchvision's FX feature extraction of the network's output, through timm's wrapper (its
    no-trace modules and functions), as timm's FX tests build it."""
    train_nodes, eval_nodes = _fx.get_graph_node_names(model)
    return _fx.create_feature_extractor(model, [train_nodes[-1]] if train else [eval_nodes[-1]])


@pytest.mark.parametrize("name,kwargs", [(n, {}) for n in ENCODERS]
                         + [("resnet18_cifar_decayed", dict(kind="learnable")),
                            ("vit_tiny_patch16_224_decayed", dict(kind="scaled_sum"))])
def test_fx_traces_the_decayed_blocks_to_the_eager_numbers(name, kwargs):
    model = small(name, **kwargs).eval()
    x = torch.randn(2, *input_size(model, name))
    with torch.no_grad():
        eager = model(x)
        traced = next(iter(fx_extractor(model, train=False)(x).values()))
    torch.testing.assert_close(traced, eager, rtol=0, atol=0)
    model.train()
    out = next(iter(fx_extractor(model, train=True)(x).values()))
    out.mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


@pytest.mark.parametrize("name", [*ENCODERS, *WHOLE_NETWORKS])
def test_factory_arguments_device_dtype_and_unknown_ones(name):
    model = small(name, device="meta", dtype=torch.float32)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    model = small(name, dtype=torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    with pytest.raises(TypeError):
        small(name, not_a_model_arg=1)
    cfg = model.pretrained_cfg
    assert cfg["input_size"][0] == 3 and cfg["first_conv"] + ".weight" in model.state_dict()


@pytest.mark.parametrize("name", list(WHOLE_NETWORKS))
def test_the_whole_networks_are_not_feature_backbones(name):
    with pytest.raises(ValueError, match="not a feature backbone.*vit_\\*_decayed"):
        small(name, features_only=True)


def test_the_mae_takes_timm_s_img_size_and_in_chans():
    mae = small("mae_vit_tiny_patch4_32_decayed", img_size=16, in_chans=1)
    assert (mae.img_size, mae.in_chans) == (16, 1)
    loss, pred, mask = mae(torch.randn(2, 1, 16, 16))
    assert pred.shape == (2, 16, 16) and mask.shape == (2, 16)
    with pytest.raises(TypeError, match="img_size"):
        small("mae_vit_tiny_patch4_32_decayed", image_size=16)
    with pytest.raises(ValueError, match="no classifier"):
        small("mae_vit_tiny_patch4_32_decayed", num_classes=10)


def test_the_mae_s_forward_intermediates_is_timm_s_and_the_evaluations_read_it():
    """One meaning on the registered networks: the MAE's ``forward_intermediates`` is its encoder
    as a ``vit_*_decayed`` of the same weights computes it (NCHW maps); the recipe's pooled block
    features are those maps' tokens, cls included, averaged (float64 from the maps)."""
    from lightning_mods.mae import MaskedAutoencoder

    mae = small("mae_vit_tiny_patch4_32_decayed").eval()
    vit = timm.create_model("vit_tiny_patch16_224_decayed", img_size=32, patch_size=4, embed_dim=32, depth=2,
                            num_heads=2, final_norm=False, num_classes=0).eval()
    vit.load_state_dict(mae.encoder.state_dict(), strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        final, maps = mae.forward_intermediates(x)
        want_final, want_maps = vit.forward_intermediates(x)
        torch.testing.assert_close(final, want_final, rtol=0, atol=0)
        assert [m.shape for m in maps] == [(2, 32, 8, 8)] * 2
        for got, want in zip(maps, want_maps):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        recipe = MaskedAutoencoder(MaskedAutoencoderViT(img_size=32, patch_size=4, **WHOLE_NETWORKS["mae_vit_tiny_patch4_32_decayed"]))
        recipe.network.load_state_dict(mae.state_dict(), strict=True)
        recipe.eval()
        features, pooled = recipe.forward_intermediates(x)
        with_cls = vit.forward_intermediates(x, intermediates_only=True, return_prefix_tokens=True)
    for got, (spatial, prefix) in zip(pooled, with_cls):
        tokens = spatial.double().sum(dim=(2, 3)) + prefix.double().sum(dim=1)
        torch.testing.assert_close(got.double(), tokens / (64 + 1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(features, pooled[-1], rtol=0, atol=0)  # no final norm with U-Net skips
