"""The timm registry name and the arguments that rebuild a trained network through
``timm.create_model`` (:mod:`.timm_registry`): what a hub folder's ``config.json`` records as its
``architecture`` and ``model_args``.

Every argument that shapes the network is recorded, the shortcut schedule included, so the
registry name only picks the class (its default sizes are all overridden). A network of another
class, a subclass among them, is refused in one line: the registry would build a different one.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from .masked_autoencoder import MaskedAutoencoderViT
from .resnet import ResNet18Cifar, ResNet50, ResNet50d
from .uvit import UViT

RESNETS = {ResNet18Cifar: "resnet18_cifar_decayed", ResNet50: "resnet50_decayed", ResNet50d: "resnet50d_decayed"}
VIT_WIDTHS = {192: "vit_tiny_patch16_224_decayed", 384: "vit_small_patch16_224_decayed",
              768: "vit_base_patch16_224_decayed", 1024: "vit_large_patch16_224_decayed"}
EXPORTABLE = "a MaskedAutoencoderViT (whole, or its encoder), a UViT, or a ResNet18Cifar, ResNet50 or ResNet50d"


def mae_encoder_args(mae: MaskedAutoencoderViT) -> tuple[str, dict[str, Any]]:
    """``(name, args)`` of a ``vit_*_decayed`` that is ``mae.encoder``: every block output equal, the
    tokens unpooled (``global_pool=""``; the MAE's features are the mean over all of them)."""
    _exact(mae, MaskedAutoencoderViT)
    s = mae.settings
    args = dict(img_size=s["img_size"], patch_size=s["patch_size"], in_chans=s["in_chans"],
                embed_dim=s["embed_dim"], depth=s["depth"], num_heads=s["num_heads"], mlp_ratio=s["mlp_ratio"],
                qkv_bias=True, class_token=True, global_pool="", num_classes=0,
                final_norm=bool(s["encoder_final_norm"]), shortcut=mae.shortcut.as_dict(), zero_init_branches=False)
    return VIT_WIDTHS.get(s["embed_dim"], "vit_base_patch16_224_decayed"), args


def registry_args(network: nn.Module, recorded: Optional[dict[str, Any]] = None) -> tuple[str, dict[str, Any]]:
    """``(name, args)`` with which ``timm.create_model`` builds ``network``'s architecture.

    ``recorded``: the constructor arguments a checkpoint recorded for a network that keeps no
    ``settings`` of its own (the ResNets: a classifier's ``backbone`` ``init_args``)."""
    if type(network) is MaskedAutoencoderViT:
        args = dict(network.settings)
        big = args["img_size"] >= 224
        return ("mae_vit_base_patch16_decayed" if big else "mae_vit_tiny_patch4_32_decayed"), args
    if type(network) is UViT:
        return "uvit_small_patch2_32_decayed", dict(network.settings)
    name = RESNETS.get(type(network))
    if name is not None:
        given = getattr(network, "_model_args", None) or dict(recorded or {})
        args = {k: v for k, v in given.items() if k not in ("pretrained", "pretrained_cfg", "pretrained_cfg_overlay")}
        args.update(shortcut=network.shortcut.as_dict(), num_classes=int(network.num_classes),
                    in_chans=int(network.conv1.in_channels if isinstance(network.conv1, nn.Conv2d)
                                 else network.conv1[0].in_channels))
        return name, args
    _exact(network, None)
    raise AssertionError  # unreachable: _exact refused it


def _exact(network: nn.Module, cls: Optional[type]) -> None:
    if cls is None or type(network) is not cls:
        kind = type(network).__name__
        raise ValueError(f"export: a {kind} has no name in timm's registry that builds it exactly; exportable are "
                         f"{EXPORTABLE}")
