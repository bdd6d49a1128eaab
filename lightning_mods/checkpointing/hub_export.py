"""A trained network in timm's hub layout: ``config.json`` (``architecture``, ``model_args`` with
the shortcut schedule, ``pretrained_cfg`` with the data's mean, std, size and classes),
``model.safetensors`` and a model card (``README.md``).

The folder is written by timm's own ``save_for_hf`` (what ``push_to_hf_hub`` uploads) from a
network that ``timm.create_model`` built from the recorded name and arguments, holding the run's
weights, and whose outputs were checked equal to the run's own network before anything is
written. ``timm.create_model("local-dir:FOLDER", pretrained=True)`` rebuilds it (after
``import lightning_mods.backbone``, which registers the decayed networks).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_mods.backbone._hub_args import EXPORTABLE, mae_encoder_args, registry_args
from lightning_mods.checkpointing._model_card import model_card_text
from lightning_mods.checkpointing.rebuild import load_checkpoint, load_run

PARTS = ("auto", "encoder", "whole")


@dataclass
class Export:
    """What is exported: the run's network, the timm name and arguments that rebuild it, and
    what the model card says of it."""
    network: nn.Module
    architecture: str
    model_args: dict[str, Any]
    what: str  # "the MAE's encoder", ...
    data_config: dict[str, Any] = field(default_factory=dict)
    label_names: Optional[list[str]] = None


def choose_network(module: nn.Module, hparams: dict[str, Any], part: str) -> Export:
    """The network of a recipe to export: an MAE's encoder (``part`` auto or encoder) or whole MAE,
    a diffusion model's U-ViT, a classifier's ResNet."""
    from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT

    if part not in PARTS:
        raise ValueError(f"export: part must be one of {', '.join(PARTS)}, got {part!r}")
    network = getattr(module, "network", None)
    if isinstance(network, MaskedAutoencoderViT):
        if part == "whole":
            return Export(network, *registry_args(network), what="the whole MAE (encoder and decoder)")
        return Export(network.encoder, *mae_encoder_args(network), what="the MAE's encoder")
    if part != "auto":
        raise ValueError(f"export: --part {part} is for an MAE; a {type(module).__name__} has one network to export")
    if isinstance(network, nn.Module) and hasattr(network, "reset_classifier"):  # a classifier's timm network
        recorded = hparams.get("network")
        recorded = recorded.get("init_args") if isinstance(recorded, dict) else None
        return Export(network, *registry_args(network, recorded), what=f"the classifier's {type(network).__name__}")
    if isinstance(network, nn.Module):
        return Export(network, *registry_args(network), what=f"the {type(network).__name__} of the diffusion model")
    raise ValueError(f"export: a {type(module).__name__} holds no network to export; exportable are {EXPORTABLE}")


def data_settings(export: Export, datamodule: Any) -> None:
    """The data the network was trained on, as timm's ``pretrained_cfg`` spells it."""
    if datamodule is None:
        return
    size = getattr(datamodule, "image_size", None)
    chans = getattr(datamodule, "in_chans", None)
    if size is not None and chans is not None:
        export.data_config["input_size"] = (int(chans), int(size), int(size))
    for key in ("mean", "std"):
        if getattr(datamodule, key, None) is not None:
            export.data_config[key] = tuple(float(v) for v in getattr(datamodule, key))
    export.data_config["crop_pct"] = float(getattr(datamodule, "eval_crop_ratio", 1.0))
    classes = int(export.model_args.get("num_classes") or 0)
    if classes and export.architecture.startswith(("resnet", "vit")):
        names = getattr(datamodule, "class_names", None)
        export.label_names = [str(n) for n in names] if names else [str(i) for i in range(classes)]


def rebuilt(export: Export) -> nn.Module:
    """``timm.create_model(architecture, **model_args)`` holding the run's weights (strictly), its
    outputs checked equal to the run's network in float32."""
    import timm

    import lightning_mods.backbone  # noqa: F401  (registers the decayed networks)

    model = timm.create_model(export.architecture, **export.model_args)
    try:
        model.load_state_dict(export.network.state_dict(), strict=True)
    except RuntimeError as err:
        raise ValueError(f"export: {export.architecture} built from the recorded arguments does not take the run's "
                         f"weights: {str(err).splitlines()[0]}") from None
    difference = output_difference(export.network, model, export.model_args)
    if difference != 0.0:
        raise ValueError(f"export: {export.architecture} rebuilt from the recorded arguments computes another function "
                         f"(max abs difference {difference:.3g}); nothing was written")
    return model


def outputs(network: nn.Module, images: torch.Tensor) -> list[torch.Tensor]:
    """What ``network`` computes on ``images`` (eval mode, seeded): an MAE's features and its
    reconstruction of a seeded mask, a U-ViT's noise prediction at two timesteps (and two classes
    when conditional), a classifier's or encoder's features and output."""
    from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
    from lightning_mods.backbone.uvit import UViT

    if isinstance(network, MaskedAutoencoderViT):
        return [network.forward_features(images), *network(images, generator=torch.Generator().manual_seed(1))]
    if isinstance(network, UViT):
        labels = torch.tensor([0, 1]) if network.settings["num_classes"] else None
        return [network(images, torch.tensor([10, 500]), labels)]
    return [network.forward_features(images), network(images)]


def output_difference(ours: nn.Module, theirs: nn.Module, args: dict[str, Any]) -> float:
    """The largest difference between the two networks' outputs on the same seeded input."""
    size = args.get("img_size", 224)
    size = size[0] if isinstance(size, (tuple, list)) else int(size)
    images = torch.randn(2, int(args.get("in_chans", 3)), size, size, generator=torch.Generator().manual_seed(0))
    modes = ours.training, theirs.training
    ours.eval(), theirs.eval()
    try:
        with torch.no_grad():
            pairs = zip(outputs(ours, images), outputs(theirs, images))
            return max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
    finally:
        ours.train(modes[0]), theirs.train(modes[1])


def export_checkpoint(checkpoint: str | os.PathLike, folder: str | os.PathLike, part: str = "auto",
                      overwrite: bool = False) -> tuple[Path, Export]:
    """Write the network of ``checkpoint`` to ``folder`` in timm's hub layout (whole or not at
    all: written beside it, then renamed into place). An existing non-empty ``folder`` is refused
    unless ``overwrite``."""
    from timm.models import save_for_hf

    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())) and not overwrite:
        raise ValueError(f"export: {folder} exists and is not empty; pass --overwrite to replace it")
    ckpt = load_checkpoint(checkpoint)
    try:
        module, datamodule = load_run(checkpoint, ckpt=ckpt)
    except ValueError:  # the data cannot be rebuilt here (its files): export without its settings
        module, datamodule = load_run(checkpoint, with_data=False, ckpt=ckpt)
    export = choose_network(module, dict(ckpt.get("hyper_parameters") or {}), part)
    data_settings(export, datamodule)
    model = rebuilt(export)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        config = {"label_names": export.label_names} if export.label_names else {}
        save_for_hf(model, staging, model_config=config, safe_serialization=True,
                    data_config=export.data_config or None)
        (staging / "README.md").write_text(model_card_text(export, ckpt, checkpoint, datamodule, folder.name), encoding="utf-8")
        _replace_folder(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder, export


def _replace_folder(staging: Path, folder: Path) -> None:
    """Put ``staging`` where ``folder`` is (an old ``folder`` removed only once the new one is in place)."""
    if not folder.exists():
        os.replace(staging, folder)
        return
    old = folder.with_name(f".{folder.name}.replaced")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(folder, old)
    os.replace(staging, folder)
    shutil.rmtree(old, ignore_errors=True)
