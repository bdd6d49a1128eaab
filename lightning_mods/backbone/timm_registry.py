"""The decayed networks in timm's model registry, so code built on timm makes them by name.

Importing :mod:`lightning_mods.backbone` registers them::

    import lightning_mods.backbone  # noqa: F401
    model = timm.create_model("vit_base_patch16_224_decayed", alpha_min=0.6)

``alpha_min`` and ``kind`` set the linear (or any built-in) decayed identity shortcut of the
decay paper, section 3.1 (``shortcut=`` takes a whole :class:`ShortcutSchedule`); every other
argument is timm's (``img_size``, ``in_chans``, ``num_classes``, ``device``, ``dtype``, ...).

The encoders (``vit_*_decayed``, ``resnet*_decayed``) keep the contract of timm's own ViT and
ResNet, as the installed timm release's ``tests/test_models.py`` writes it: forward and backward,
``default_cfgs``, ``features_only`` (the ViTs through ``forward_intermediates``' getter),
``forward_intermediates`` and torchvision's FX feature extraction (the decayed sum is an FX leaf).
TorchScript is not supported: ``torch.jit`` is in maintenance and the decayed blocks are not
scripted. The whole pre-training networks (``mae_*``, ``uvit_*``) carry a pretrained config and
take timm's factory arguments; their docstrings say which of timm's tests apply.

``pretrained=True`` with ``pretrained_cfg_overlay=dict(file=PATH)`` loads a local file (nothing is
downloaded): into an MAE, a file of either MAE repository or a shortcutlab MAE's state_dict
(:func:`~lightning_mods.backbone.mae_weights.checkpoint_filter_fn`); into a ``vit_*_decayed``,
the encoder half of those, or an encoder exported by ``python -m commands.convert_mae
export-encoder`` (:func:`~lightning_mods.backbone.mae_weights.encoder_filter_fn`). A file that
would leave any weight at its initial value (a new classifier head aside) is refused in one line
naming the weights and the arguments the file matches. A file whose shortcut weights disagree
with the schedule asked for loads the file's (and warns), as every shortcut-aware block does.
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from .mae_weights import checkpoint_filter_fn, encoder_filter_fn, keep_fresh_head, require_filled, unwrap
from .masked_autoencoder import MaskedAutoencoderViT
from .resnet import ResNet50, ResNet50d, ResNet18Cifar
from .shortcut import ShortcutSchedule
from .uvit import UViT
from .vit import DecayedVisionTransformer


def _schedule(kwargs: dict[str, Any]) -> ShortcutSchedule:
    """``shortcut=`` as given, else a schedule of the ``kind``/``alpha_min``/... given (the
    schedule's own defaults for the rest)."""
    shortcut = kwargs.pop("shortcut", None)
    fields = {name: kwargs.pop(name) for name in ("kind", "alpha_min", "branches", "scale") if name in kwargs}
    return ShortcutSchedule.coerce(shortcut) if shortcut is not None else ShortcutSchedule(**fields)


def _build(cls: Callable[..., nn.Module], variant: str, pretrained: bool, filter_fn: Callable[..., Any],
           **kwargs: Any) -> nn.Module:
    # both MAE repositories pickle their argparse.Namespace next to the weights: let timm's
    # weights-only torch.load read it (a plain attribute bag)
    with torch.serialization.safe_globals([argparse.Namespace]):
        return build_model_with_cfg(cls, variant, pretrained, pretrained_filter_fn=filter_fn,
                                    pretrained_strict=True, **kwargs)


def _vit(variant: str, pretrained: bool, arch: dict[str, Any], kwargs: dict[str, Any]) -> nn.Module:
    shortcut = _schedule(kwargs)
    out_indices = kwargs.pop("out_indices", 3)  # timm's ViT: features_only through forward_intermediates
    return _build(DecayedVisionTransformer, variant, pretrained, encoder_filter_fn, shortcut=shortcut,
                  feature_cfg=dict(out_indices=out_indices, feature_cls="getter"), **{**arch, **kwargs})


def _resnet(cls: Callable[..., nn.Module], variant: str, pretrained: bool, kwargs: dict[str, Any]) -> nn.Module:
    return _build(cls, variant, pretrained, own_filter_fn, shortcut=_schedule(kwargs), **kwargs)


def own_filter_fn(state_dict: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """A shortcutlab state_dict of this very network (a checkpoint's ``state_dict`` unwrapped), its
    classifier head new where the file's is for other classes: refused in one line unless it
    fills the rest of the network."""
    own = model.state_dict()
    state = keep_fresh_head(unwrap(state_dict), own)
    require_filled(state, own, type(model).__name__, lambda *_: [])
    return state


def _cfg(**kwargs: Any) -> dict[str, Any]:
    return {"num_classes": 1000, "input_size": (3, 224, 224), "crop_pct": 0.9, "interpolation": "bicubic",
            "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225), "license": "apache-2.0", **kwargs}


_VIT = dict(first_conv="patch_embed.proj", classifier="head", fixed_input_size=True, pool_size=None)
_RESNET = dict(first_conv="conv1", classifier="fc", crop_pct=0.95, pool_size=(7, 7))
# whole pre-training networks: no classifier; MAE's pixels normalised with ImageNet's statistics,
# U-ViT's in [-1, 1]
_MAE = dict(first_conv="encoder.patch_embed.proj", classifier=None, num_classes=0, fixed_input_size=True,
            crop_pct=1.0)
_UVIT = dict(first_conv="patch_embed.proj", classifier=None, num_classes=0, fixed_input_size=True,
             input_size=(3, 32, 32), crop_pct=1.0, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))

default_cfgs = generate_default_cfgs({
    "vit_tiny_patch16_224_decayed": _cfg(**_VIT),
    "vit_small_patch16_224_decayed": _cfg(**_VIT),
    "vit_base_patch16_224_decayed": _cfg(**_VIT),
    "vit_large_patch16_224_decayed": _cfg(**_VIT),
    "resnet50_decayed": _cfg(**_RESNET),
    "resnet50d_decayed": _cfg(**{**_RESNET, "first_conv": "conv1.0"}),
    "resnet18_cifar_decayed": _cfg(**{**_RESNET, "input_size": (3, 32, 32), "pool_size": (4, 4), "crop_pct": 1.0,
                                      "num_classes": 10}),
    "mae_vit_base_patch16_decayed": _cfg(**_MAE),
    "mae_vit_tiny_patch4_32_decayed": _cfg(**{**_MAE, "input_size": (3, 32, 32)}),
    "uvit_small_patch2_32_decayed": _cfg(**_UVIT),
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
    return _resnet(ResNet50, "resnet50_decayed", pretrained, kwargs)


@register_model
def resnet50d_decayed(pretrained: bool = False, **kwargs: Any) -> ResNet50d:
    """timm's ResNet-50-D with decayed identity shortcuts."""
    return _resnet(ResNet50d, "resnet50d_decayed", pretrained, kwargs)


@register_model
def resnet18_cifar_decayed(pretrained: bool = False, **kwargs: Any) -> ResNet18Cifar:
    """CIFAR ResNet-18 (3x3 stem, no max-pool; ``num_blocks`` 8 to 16) with decayed identity shortcuts."""
    return _resnet(ResNet18Cifar, "resnet18_cifar_decayed", pretrained, kwargs)


# --- whole networks of the two papers (not classifiers, not feature backbones) -------------------
def _on_device(cls: Callable[..., nn.Module], variant: str) -> Callable[..., nn.Module]:
    """``cls`` taking timm's factory arguments: ``device``, ``dtype`` and ``img_size`` (an int or a
    square ``(H, W)``), and for the MAE timm's
    ``num_classes`` (which must be 0: an MAE has no classifier)."""
    def build(*, device: Optional[Any] = None, dtype: Optional[torch.dtype] = None, **kwargs: Any) -> nn.Module:
        size = kwargs.pop("img_size", None)
        if cls is MaskedAutoencoderViT:
            if kwargs.pop("num_classes", 0):
                raise ValueError(f"{variant}: an MAE has no classifier (num_classes must be 0); fine-tune its encoder "
                                 "as a vit_*_decayed with num_classes")
        if size is not None:
            kwargs["img_size"] = _square(size, variant)
        with torch.device(device) if device is not None else nullcontext():
            net = cls(**kwargs)
        return net.to(device=device, dtype=dtype)  # what the context missed (tensors made from numpy)
    build.__name__ = build.__qualname__ = cls.__name__
    return build


def _square(size: Any, variant: str) -> int:
    """timm's ``img_size`` (an int or ``(H, W)``) as one side."""
    if isinstance(size, (tuple, list)):
        if len(size) != 2 or size[0] != size[1]:
            raise ValueError(f"{variant}: img_size must be square, got {tuple(size)}")
        size = size[0]
    return int(size)


def _network(cls: Callable[..., nn.Module], variant: str, pretrained: bool, arch: dict[str, Any],
             kwargs: dict[str, Any], filter_fn: Callable[..., Any]) -> nn.Module:
    if kwargs.get("features_only"):
        raise ValueError(f"{variant} is a whole pre-training network, not a feature backbone: build its encoder "
                         "(vit_*_decayed, which loads an MAE's encoder half) with features_only=True")
    if "image_size" in kwargs:
        raise TypeError(f"{variant}: the input size is timm's img_size (image_size before release 0.3)")
    return _build(_on_device(cls, variant), variant, pretrained, filter_fn, shortcut=_schedule(kwargs),
                  **{**arch, **kwargs})


MAE_BASE = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, decoder_embed_dim=512, decoder_depth=8,
                decoder_num_heads=16)


@register_model
def mae_vit_base_patch16_decayed(pretrained: bool = False, **kwargs: Any) -> MaskedAutoencoderViT:
    """The decay paper's ImageNet MAE: ViT-B/16 encoder with decayed shortcuts, U-Net skip
    decoder of width 512 and depth 8 (``unet_skips=False, alpha_min=1.0``: He et al.'s MAE).

    ``pretrained=True, pretrained_cfg_overlay=dict(file=PATH)`` loads either MAE repository's
    ``checkpoint-*.pth`` or ``mae_pretrain_vit_*.pth``/``mae_visualize_vit_*.pth``, or a shortcutlab
    MAE's state_dict (:func:`~lightning_mods.backbone.mae_weights.checkpoint_filter_fn`).

    Of timm's model tests, the creation and ``default_cfgs`` checks apply (pretrained config,
    ``device``/``dtype``, unknown arguments refused, ``first_conv``); the forward, classifier and
    feature ones do not: ``forward`` returns ``(loss, prediction, mask)`` of a random mask, there is
    no classifier to reset, and features come from the encoder (``vit_*_decayed``).
    """
    return _network(MaskedAutoencoderViT, "mae_vit_base_patch16_decayed", pretrained, MAE_BASE, kwargs,
                    checkpoint_filter_fn)


@register_model
def mae_vit_tiny_patch4_32_decayed(pretrained: bool = False, **kwargs: Any) -> MaskedAutoencoderViT:
    """The decay paper's CIFAR MAE (configs/mae/base.yaml): ViT-Ti/4 at 32 pixels, depth 12, skip
    decoder of width 256 and depth 4. Loading and timm's tests as :func:`mae_vit_base_patch16_decayed`."""
    return _network(MaskedAutoencoderViT, "mae_vit_tiny_patch4_32_decayed", pretrained,
                    dict(patch_size=4, embed_dim=192, depth=12, num_heads=3, decoder_embed_dim=256, decoder_depth=4,
                         decoder_num_heads=8), kwargs, checkpoint_filter_fn)


@register_model
def uvit_small_patch2_32_decayed(pretrained: bool = False, **kwargs: Any) -> UViT:
    """U-ViT-S/2 of the decay paper's CIFAR diffusion (configs/diffusion/base.yaml): 32 pixels,
    width 512, depth 12, 8 heads, no qkv bias, zero-initialised branch ends; ``num_classes`` > 0
    for class conditioning (it counts the labels the network is conditioned on: U-ViT has no
    classifier). ``pretrained=True, pretrained_cfg_overlay=dict(file=PATH)`` loads a shortcutlab
    U-ViT's state_dict (a ``DiffusionModule`` checkpoint's ``model.`` weights).

    Of timm's model tests, the creation and ``default_cfgs`` checks apply; the forward, classifier
    and feature ones do not: ``forward(x, timesteps)`` predicts noise from a noised image and a
    timestep, and returns an image, not logits or features.
    """
    return _network(UViT, "uvit_small_patch2_32_decayed", pretrained,
                    dict(patch_size=2, embed_dim=512, depth=12, num_heads=8, qkv_bias=False,
                         mlp_time_embed=False, final_conv=True, zero_init_branches=True), kwargs, uvit_filter_fn)


def uvit_filter_fn(state_dict: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """A U-ViT state_dict, or a ``DiffusionModule`` checkpoint's (its ``model.`` weights), refused in
    one line unless it fills the network."""
    state = unwrap(state_dict)
    if any(k.startswith("model.") for k in state):
        state = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    require_filled(state, model.state_dict(), type(model).__name__, lambda *_: [])
    return state
