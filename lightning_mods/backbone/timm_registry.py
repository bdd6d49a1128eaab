"""The decayed backbones in timm's model registry, so code built on timm makes them by name.

Importing :mod:`lightning_mods.backbone` registers them::

    import lightning_mods.backbone  # noqa: F401
    model = timm.create_model("vit_base_patch16_224_decayed", alpha_min=0.6)

``alpha_min`` and ``kind`` set the linear (or any built-in) decayed identity shortcut of the
decay paper, section 3.1 (``shortcut=`` takes a whole :class:`ShortcutSchedule`); every other
argument is timm's. ``pretrained=True`` with ``pretrained_cfg_overlay=dict(file=PATH)`` loads an
encoder exported by ``python -m commands.convert_mae export-encoder`` (the encoder's own
state_dict, shortcut weights included; a checkpoint's ``encoder.`` prefix is dropped too):
nothing is downloaded. A file whose shortcut weights disagree with the schedule asked for loads
the file's (and warns), as every shortcut-aware block does.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from .masked_autoencoder import MaskedAutoencoderViT
from .resnet import ResNet50, ResNet50d, ResNet18Cifar
from .shortcut import ShortcutSchedule
from .uvit import UViT
from .vit import DecayedVisionTransformer

ENCODER_PREFIX = "encoder."


def _schedule(kwargs: dict[str, Any]) -> ShortcutSchedule:
    shortcut = kwargs.pop("shortcut", None)
    kind, alpha_min = kwargs.pop("kind", "linear"), kwargs.pop("alpha_min", 0.6)
    return ShortcutSchedule.coerce(shortcut) if shortcut is not None else ShortcutSchedule(kind=kind, alpha_min=alpha_min)


def exported_state_dict(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """An exported encoder's weights as ``model``'s names: a shortcutlab checkpoint's
    ``encoder.`` prefix dropped; a head the file lacks is left to timm (which re-initialises it)."""
    if state_dict and all(k.startswith(ENCODER_PREFIX) for k in state_dict):
        state_dict = {k[len(ENCODER_PREFIX):]: v for k, v in state_dict.items()}
    elif any(k.startswith(ENCODER_PREFIX) for k in state_dict):  # a whole MAE: keep the encoder
        state_dict = {k[len(ENCODER_PREFIX):]: v for k, v in state_dict.items() if k.startswith(ENCODER_PREFIX)}
    own = model.state_dict()
    for name in ("head.weight", "head.bias", "fc.weight", "fc.bias"):
        if name not in state_dict and name in own:
            state_dict[name] = own[name]  # no trained head in an encoder: keep the new one
    return state_dict


def _build(cls: Callable[..., nn.Module], variant: str, pretrained: bool, **kwargs: Any) -> nn.Module:
    return build_model_with_cfg(cls, variant, pretrained, pretrained_filter_fn=exported_state_dict,
                                pretrained_strict=True, **kwargs)


def _vit(variant: str, pretrained: bool, arch: dict[str, Any], kwargs: dict[str, Any]) -> nn.Module:
    shortcut = _schedule(kwargs)
    return _build(DecayedVisionTransformer, variant, pretrained, shortcut=shortcut, **{**arch, **kwargs})


def _cfg(**kwargs: Any) -> dict[str, Any]:
    return {"num_classes": 1000, "input_size": (3, 224, 224), "crop_pct": 0.9, "interpolation": "bicubic",
            "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225), "license": "apache-2.0", **kwargs}


default_cfgs = generate_default_cfgs({
    "vit_tiny_patch16_224_decayed": _cfg(first_conv="patch_embed.proj", classifier="head"),
    "vit_small_patch16_224_decayed": _cfg(first_conv="patch_embed.proj", classifier="head"),
    "vit_base_patch16_224_decayed": _cfg(first_conv="patch_embed.proj", classifier="head"),
    "vit_large_patch16_224_decayed": _cfg(first_conv="patch_embed.proj", classifier="head"),
    "resnet50_decayed": _cfg(first_conv="conv1", classifier="fc", crop_pct=0.95),
    "resnet50d_decayed": _cfg(first_conv="conv1.0", classifier="fc", crop_pct=0.95),
    "resnet18_cifar_decayed": _cfg(first_conv="conv1", classifier="fc", input_size=(3, 32, 32), crop_pct=1.0,
                                   num_classes=10),
})


@register_model
def vit_tiny_patch16_224_decayed(pretrained: bool = False, **kwargs: Any) -> DecayedVisionTransformer:
    """ViT-Ti/16 with decayed identity shortcuts."""
    return _vit("vit_tiny_patch16_224_decayed", pretrained, dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
                kwargs)


@register_model
def vit_small_patch16_224_decayed(pretrained: bool = False, **kwargs: Any) -> DecayedVisionTransformer:
    """ViT-S/16 with decayed identity shortcuts."""
    return _vit("vit_small_patch16_224_decayed", pretrained, dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
                kwargs)


@register_model
def vit_base_patch16_224_decayed(pretrained: bool = False, **kwargs: Any) -> DecayedVisionTransformer:
    """ViT-B/16 with decayed identity shortcuts (the decay paper's MAE encoder)."""
    return _vit("vit_base_patch16_224_decayed", pretrained, dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
                kwargs)


@register_model
def vit_large_patch16_224_decayed(pretrained: bool = False, **kwargs: Any) -> DecayedVisionTransformer:
    """ViT-L/16 with decayed identity shortcuts."""
    return _vit("vit_large_patch16_224_decayed", pretrained,
                dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16), kwargs)


@register_model
def resnet50_decayed(pretrained: bool = False, **kwargs: Any) -> ResNet50:
    """timm's ResNet-50 with decayed identity shortcuts."""
    return _build(ResNet50, "resnet50_decayed", pretrained, shortcut=_schedule(kwargs), **kwargs)


@register_model
def resnet50d_decayed(pretrained: bool = False, **kwargs: Any) -> ResNet50d:
    """timm's ResNet-50-D with decayed identity shortcuts."""
    return _build(ResNet50d, "resnet50d_decayed", pretrained, shortcut=_schedule(kwargs), **kwargs)


@register_model
def resnet18_cifar_decayed(pretrained: bool = False, **kwargs: Any) -> ResNet18Cifar:
    """CIFAR ResNet-18 (3x3 stem, no max-pool; ``num_blocks`` 8 to 16) with decayed identity shortcuts."""
    return _build(ResNet18Cifar, "resnet18_cifar_decayed", pretrained, shortcut=_schedule(kwargs), **kwargs)


# --- whole networks of the two papers (not classifiers: no head, no pretrained weights) ---------
TIMM_ONLY = ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir")  # what create_model adds for its builder


def _network(cls: Callable[..., nn.Module], variant: str, pretrained: bool, arch: dict[str, Any],
             kwargs: dict[str, Any]) -> nn.Module:
    """A whole network of the papers by name: no weights are registered for these."""
    if pretrained:
        raise ValueError(f"{variant}: no pretrained weights are registered; load a checkpoint's state_dict "
                         "(lightning_mods.backbone.masked_autoencoder.checkpoint_filter_fn reads both MAE repositories' names)")
    kwargs = {k: v for k, v in kwargs.items() if k not in TIMM_ONLY}
    return cls(shortcut=_schedule(kwargs), **{**arch, **kwargs})


MAE_BASE = dict(image_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12, decoder_embed_dim=512,
                decoder_depth=8, decoder_num_heads=16)


@register_model
def mae_vit_base_patch16_decayed(pretrained: bool = False, **kwargs: Any) -> MaskedAutoencoderViT:
    """The decay paper's ImageNet MAE: ViT-B/16 encoder with decayed shortcuts, U-Net skip
    decoder of width 512 and depth 8 (``unet_skips=False, alpha_min=1.0``: He et al.'s MAE)."""
    return _network(MaskedAutoencoderViT, "mae_vit_base_patch16_decayed", pretrained, MAE_BASE, kwargs)


@register_model
def mae_vit_tiny_patch4_32_decayed(pretrained: bool = False, **kwargs: Any) -> MaskedAutoencoderViT:
    """The decay paper's CIFAR MAE (configs/mae/base.yaml): ViT-Ti/4 at 32 pixels, depth 12, skip
    decoder of width 256 and depth 4."""
    return _network(MaskedAutoencoderViT, "mae_vit_tiny_patch4_32_decayed", pretrained,
                    dict(image_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3, decoder_embed_dim=256,
                         decoder_depth=4, decoder_num_heads=8), kwargs)


@register_model
def uvit_small_patch2_32_decayed(pretrained: bool = False, **kwargs: Any) -> UViT:
    """U-ViT-S/2 of the decay paper's CIFAR diffusion (configs/diffusion/base.yaml): 32 pixels,
    width 512, depth 12, 8 heads, no qkv bias, zero-initialised branch ends; ``num_classes`` > 0
    for class conditioning."""
    return _network(UViT, "uvit_small_patch2_32_decayed", pretrained,
                    dict(img_size=32, patch_size=2, embed_dim=512, depth=12, num_heads=8, qkv_bias=False,
                         mlp_time_embed=False, final_conv=True, zero_init_branches=True), kwargs)
