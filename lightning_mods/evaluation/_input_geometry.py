"""The images a network takes against the images the data gives, checked before an evaluation
runs: a probe or fine-tuning of a checkpoint at another image size or channel count would
otherwise stop at the first batch with a traceback from deep inside the network."""
from __future__ import annotations

from typing import Any, Optional

from torch import nn


def network_geometry(network: nn.Module) -> tuple[Optional[int], Optional[int]]:
    """``(image size, channels)`` a network takes (None where it takes any): its recipe's
    ``image_size``/``in_chans`` settings, else a timm patch embedding's fixed size and channels."""
    hp = getattr(network, "hparams", None) or {}
    if hp.get("image_size"):
        return int(hp["image_size"]), int(hp.get("in_chans", 3))
    for module in network.modules():
        embed = getattr(module, "patch_embed", None)
        if embed is not None and getattr(embed, "img_size", None) and getattr(embed, "strict_img_size", True):
            return int(embed.img_size[0]), int(embed.proj.in_channels)
    return None, None


def check_input_geometry(network: nn.Module, datamodule: Any, owner: str,
                         advice: str = "evaluate the checkpoint on data of its own geometry") -> None:
    """One-line ``ValueError`` when ``datamodule`` (its ``image_size``/``in_chans``) gives images
    ``network`` cannot take."""
    size, chans = network_geometry(network)
    data_size, data_chans = getattr(datamodule, "image_size", None), getattr(datamodule, "in_chans", None)
    wrong = []
    if size is not None and isinstance(data_size, int) and data_size != size:
        wrong.append(f"{data_size}-pixel images where the network takes {size} (data.init_args.image_size={size})")
    if chans is not None and isinstance(data_chans, int) and data_chans != chans:
        wrong.append(f"{data_chans}-channel images where the network takes {chans}")
    if wrong:
        raise ValueError(f"{owner}: the data gives {' and '.join(wrong)}; {advice}")
