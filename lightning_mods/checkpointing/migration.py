"""Checkpoints written by earlier releases, brought to this release's layout: every upgrade step in
one place, each named with the releases that wrote the old layout and the release that stops
reading it (as Lightning's ``lightning.pytorch.utilities.migration``).

:func:`upgrade` changes a checkpoint dictionary in place. :func:`lightning_mods.checkpointing.rebuild.load_checkpoint`
calls it on every file it reads (``load_run``, the probe, fine-tuning, ``--ckpt_path`` checks), and a
fit's checkpoint IO (:class:`~lightning_mods.checkpointing.checkpoint_io.AtomicCheckpointIO`, which the
reliability callbacks install) and the recipes' ``on_load_checkpoint`` and ``load_from_checkpoint``
(:mod:`lightning_mods.checkpointing.earlier_releases`) on the one Lightning reads. The steps that
need what the checkpoint meets (a network built, a callback list) or concern one part's state are
called by their owners, also when a plain ``Trainer`` resumes: :func:`older_checkpoint_shortcut_weights`,
:func:`rekey_callback_state`, :func:`effective_rank_history` and :func:`datamodule_state`.

At each step's ``dropped_in`` release the step goes (a test fails until it has), and checkpoints of
its ``written_by`` releases must be loaded once by a release before it and saved again.
"""
from __future__ import annotations

import copy
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Optional

import torch
from packaging.version import InvalidVersion, Version
from torch import nn

from lightning_mods.backbone.residual import SHORTCUT_KEY

MAE_RECIPE = "lightning_mods.mae.MaskedAutoencoder"
MAE_NETWORK = "lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT"
# the recipe's own arguments; every other saved setting was the network's
MAE_RECIPE_SETTINGS = ("base_lr", "weight_decay", "betas", "warmup_epochs", "min_lr_ratio", "num_reconstructions")
DIFFUSION_RECIPE = "lightning_mods.diffusion.DiffusionModule"
UVIT = "lightning_mods.backbone.uvit.UViT"
# the U-ViT's arguments the diffusion recipe took (its image_size is the network's img_size)
UVIT_SETTINGS = ("image_size", "in_chans", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias",
                 "mlp_time_embed", "final_conv", "shortcut", "zero_init_branches")
MODULE_STATES = ("state_dict", "current_model_state")  # the weights, and EMA's training weights beside them


@dataclass(frozen=True)
class Step:
    """One upgrade: checkpoints of the ``written_by`` releases are read until ``dropped_in``."""

    name: str
    written_by: str
    dropped_in: str
    what: str


MAE_NETWORK_MEMBER = Step(
    "mae_network_member", "0.1.0", "0.3.0",
    "MaskedAutoencoder held its network's settings and weights itself; they move under 'network'")
DIFFUSION_NETWORK_MEMBER = Step(
    "diffusion_network_member", "0.1.0", "0.3.0",
    "DiffusionModule built its U-ViT from its own settings, held as 'model'; they move under 'network'")
SHORTCUT_WEIGHTS = Step(
    "shortcut_weights", "development builds before 0.1.0", "0.3.0",
    "no <block>.shortcut_weights entries: the blocks' weights come from the checkpoint's own schedule")
CALLBACK_STATE_BY_CLASS_NAME = Step(
    "callback_state_by_class_name", "development builds before 0.1.0", "0.3.0",
    "a callback's state keyed by its bare class name; re-keyed for the one instance of the class")
ENTROPY_PROFILE = Step(
    "entropy_profile", "development builds before 0.1.0", "0.3.0",
    "EffectiveRank history entries without their per-block entropies (filled with NaN)")
DATA_ORDER = Step(
    "data_order", "development builds before 0.1.0", "0.3.0",
    "a datamodule's train position without the data order it counts in (resumed unchecked)")
CLASSIFIER_NETWORK_NAME = Step(
    "classifier_network_name", "0.2.0", "0.4.0",
    "ImageClassifier held the network it trains as 'backbone'; it is 'network', as in every training recipe")
FINETUNE_NETWORK_NAME = Step(
    "finetune_network_name", "0.2.0", "0.4.0",
    "FineTuneClassifier took its MAE as 'encoder' (allow_encoder_override) and held the network it trains as "
    "'model'; both are 'network' (allow_override)")
SPIRAL_NETWORK_MEMBER = Step(
    "spiral_network_member", "0.2.0", "0.4.0",
    "SpiralClassifier built its ResidualMLP from its own depth, width and shortcut, held as 'net'; they move "
    "under 'network'")
MAE_IMG_SIZE = Step(
    "mae_img_size", "0.2.0", "0.4.0",
    "MaskedAutoencoderViT took its input size as 'image_size'; it is timm's 'img_size', as every network's")
OVERRIDE_FLAG_NAME = Step(
    "override_flag_name", "0.2.0", "0.4.0",
    "the switch that builds with given settings where they disagree with the checkpoint was LinearProbe's "
    "allow_backbone_override and FineTuneClassifier's allow_network_override; it is allow_override everywhere")
PROBE_PARTS = Step(
    "online_probe_parts", "0.2.0", "0.4.0",
    "OnlineLinearProbe took its heads' settings, replay_samples and blocks as its own arguments; they are its "
    "heads, replay and depth (feature_dim went: the width comes from the features)")
STEPS = (MAE_NETWORK_MEMBER, DIFFUSION_NETWORK_MEMBER, SHORTCUT_WEIGHTS, CALLBACK_STATE_BY_CLASS_NAME, ENTROPY_PROFILE,
         DATA_ORDER, CLASSIFIER_NETWORK_NAME, FINETUNE_NETWORK_NAME, MAE_IMG_SIZE, SPIRAL_NETWORK_MEMBER,
         OVERRIDE_FLAG_NAME, PROBE_PARTS)
# the online probe's settings of 0.2 and where they are now ("part.setting"; None: gone)
PROBE_SETTINGS = {"num_classes": "heads.num_classes", "lr": "heads.lr", "optimizer": "heads.optimizer",
                  "momentum": "heads.momentum", "batch_norm": "heads.batch_norm", "seed": "heads.seed",
                  "replay_samples": "replay.samples", "head_batch": "replay.head_batch",
                  "head_steps": "replay.head_steps", "blocks": "depth.blocks", "feature_dim": None}
# an evaluation recipe's settings renamed: {recipe: {old: new}}
RENAMED_RECIPE_SETTINGS = {"lightning_mods.linear_probe.LinearProbe": {"allow_backbone_override": "allow_override"},
                           "lightning_mods.finetune.FineTuneClassifier": {"allow_network_override": "allow_override"}}
OLD_OVERRIDE_FLAGS = {old: new for renamed in RENAMED_RECIPE_SETTINGS.values() for old, new in renamed.items()}
SPIRAL_RECIPE = "lightning_mods.spiral_classifier.SpiralClassifier"
RESIDUAL_MLP = "lightning_mods.backbone.residual_mlp.ResidualMLP"
# a network's settings renamed: {network class: {old: new}} (a subclass renames them too)
RENAMED_NETWORK_SETTINGS = {MAE_NETWORK: {"image_size": "img_size"}}


@dataclass(frozen=True)
class RenamedNetwork:
    """A training recipe whose network had another name: its settings' old names (old -> new), the
    old prefix of its network's weights, and settings only that recipe has (to know a checkpoint
    of it built in Python, which records no class path)."""

    step: Step
    settings: dict
    weights: str
    own: tuple[str, ...]


RENAMED_NETWORKS = {
    "lightning_mods.classifier.ImageClassifier": RenamedNetwork(
        CLASSIFIER_NETWORK_NAME, {"backbone": "network"}, "backbone.", ("label_smoothing", "nesterov")),
    "lightning_mods.finetune.FineTuneClassifier": RenamedNetwork(
        FINETUNE_NETWORK_NAME, {"encoder": "network", "allow_encoder_override": "allow_override"}, "model.",
        ("layer_decay", "mixup_switch_prob")),
}


def package_version() -> Optional[str]:
    """The installed shortcutlab's version (None when the package runs uninstalled, from a checkout)."""
    try:
        return importlib.metadata.version("shortcutlab")
    except importlib.metadata.PackageNotFoundError:
        return None


VERSION_KEY = "shortcutlab_version"  # the release that wrote a checkpoint (none before 0.3)


def stamped(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint about to be saved with the installed release recorded (:data:`VERSION_KEY`; a
    shallow copy: the caller's dictionary is left as it was)."""
    version = package_version()
    return checkpoint if version is None else {**checkpoint, VERSION_KEY: version}


def _release(text: str) -> Optional[Version]:
    try:
        return Version(text)
    except InvalidVersion:  # "development builds before 0.1.0"
        return None


# the newest release whose checkpoints an upgrade step reads
NEWEST_OLD_LAYOUT = max(v for v in (_release(step.written_by) for step in STEPS) if v is not None)


def written_after_every_step(checkpoint: dict[str, Any]) -> bool:
    """Whether the checkpoint records a release newer than every release an upgrade step reads:
    its layout is this release's, nothing is guessed from its shape."""
    written = checkpoint.get(VERSION_KEY)
    release = _release(written) if isinstance(written, str) else None
    return release is not None and release > NEWEST_OLD_LAYOUT


def upgrade(checkpoint: dict[str, Any]) -> list[str]:
    """Bring a Lightning checkpoint dictionary to this release's layout, in place; the names of the
    steps applied (none for a current checkpoint: one that records a release newer than every
    step's, or one whose layout is already this release's)."""
    if written_after_every_step(checkpoint):
        return []
    member = _network_member(checkpoint) or _renamed_network(checkpoint)
    applied = [member] if member else []
    hparams = checkpoint.get("hyper_parameters")
    if isinstance(hparams, dict) and rename_network_settings(hparams):
        applied.append(MAE_IMG_SIZE.name)
    if isinstance(hparams, dict) and rename_override_flag(hparams):
        applied.append(OVERRIDE_FLAG_NAME.name)
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if key.startswith("EffectiveRank") and isinstance(state, dict) and isinstance(state.get("history"), list):
            history = effective_rank_history(state["history"])
            if history != state["history"]:
                state["history"] = history
                applied.append(ENTROPY_PROFILE.name)
    return sorted(set(applied))


def split_settings(recipe: str, settings: dict[str, Any]) -> Optional[tuple[dict[str, Any], dict[str, Any]]]:
    """:data:`MAE_NETWORK_MEMBER`, :data:`DIFFUSION_NETWORK_MEMBER`: a 0.1 recipe's settings as
    ``(its network's {"class_path", "init_args"}, the recipe's own)``; None for another recipe."""
    name = recipe.rpartition(".")[2]
    if name == "MaskedAutoencoder":  # num_classes: a link from the data the MAE never took
        network = {k: v for k, v in settings.items()
                   if not k.startswith("_") and k not in MAE_RECIPE_SETTINGS and k != "num_classes"}
        own = {k: v for k, v in settings.items() if k.startswith("_") or k in MAE_RECIPE_SETTINGS}
        return {"class_path": MAE_NETWORK, "init_args": network}, own
    if name == "SpiralClassifier":  # the spiral's 2-D points: in_features 2
        network = {k: settings[k] for k in ("depth", "width", "shortcut") if k in settings}
        own = {k: v for k, v in settings.items() if k not in ("depth", "width", "shortcut")}
        return {"class_path": RESIDUAL_MLP, "init_args": {**network, "in_features": 2,
                                                          "num_classes": settings.get("num_classes", 2)}}, own
    if name == "DiffusionModule":
        own = {k: v for k, v in settings.items() if k not in UVIT_SETTINGS}
        return {"class_path": UVIT, "init_args": uvit_settings(settings)}, own
    return None


def rename_override_flag(settings: dict[str, Any]) -> bool:
    """:data:`OVERRIDE_FLAG_NAME`: a probe's or fine-tuning's settings (its checkpoint's
    hyper-parameters, a saved config's ``init_args``) with ``allow_override``, in place; whether
    an old name was there."""
    old = [key for key in OLD_OVERRIDE_FLAGS if key in settings]
    for key in old:
        settings.setdefault(OLD_OVERRIDE_FLAGS[key], settings.pop(key))
    return bool(old)


def upgrade_model_config(model: dict[str, Any]) -> dict[str, Any]:
    """A saved config's ``model`` node (``class_path``/``init_args``) in this release's layout: a
    0.1 MAE's or diffusion model's network settings move under ``init_args.network``; a 0.2
    classifier's ``backbone`` and a fine-tuning's ``encoder`` are their ``network``; an MAE network's
    ``image_size`` is its ``img_size``; a probe's or fine-tuning's override switch is ``allow_override``."""
    model = copy.deepcopy(model)
    rename_network_settings(model)
    if isinstance(model.get("init_args"), dict):
        rename_override_flag(model["init_args"])
    init = dict(model.get("init_args") or {})
    renamed = RENAMED_NETWORKS.get(str(model.get("class_path", "")))
    if renamed and any(old in init for old in renamed.settings):
        return {**model, "init_args": {renamed.settings.get(k, k): v for k, v in init.items()}}
    split = None if "network" in init else split_settings(str(model.get("class_path", "")), init)
    if split is None:
        return dict(model)
    network, own = split
    return {**model, "init_args": {"network": network, **own}}


def probe_settings(init: dict[str, Any]) -> dict[str, Any]:
    """:data:`PROBE_PARTS`: an ``OnlineLinearProbe``'s ``init_args`` of 0.2 in this release's layout
    (``replay_samples: null`` is ``replay: null``; ``blocks: null`` no ``depth``)."""
    new = {k: v for k, v in init.items() if k not in PROBE_SETTINGS}
    if "replay_samples" in init and init["replay_samples"] is None:
        new["replay"] = None
    for old, path in PROBE_SETTINGS.items():
        if old in init and path is not None and not (old == "blocks" and init[old] is None):
            part, key = path.split(".")
            if part not in new or new[part] is not None:
                new.setdefault(part, {})[key] = init[old]
    return new


def upgrade_config(config: dict[str, Any]) -> dict[str, Any]:
    """A saved config (``model``, ``trainer.callbacks``) of an earlier release in this release's
    layout: the model by :func:`upgrade_model_config`, each online probe by :func:`probe_settings`."""
    config = copy.deepcopy(config)
    if isinstance(config.get("model"), dict):
        config["model"] = upgrade_model_config(config["model"])
    for callback in (config.get("trainer") or {}).get("callbacks") or []:
        init = callback.get("init_args") if isinstance(callback, dict) else None
        if str(callback.get("class_path", "")).endswith("OnlineLinearProbe") and isinstance(init, dict) \
                and set(init) & set(PROBE_SETTINGS):
            callback["init_args"] = probe_settings(init)
    return config


def uvit_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The U-ViT's arguments among a 0.1 diffusion recipe's settings (its num_classes when conditional)."""
    network = {("img_size" if k == "image_size" else k): v for k, v in settings.items() if k in UVIT_SETTINGS}
    if settings.get("class_conditional"):
        network["num_classes"] = settings.get("num_classes", 0)
    return network


# the recipes whose network moved under "network": their step, and the prefix their network's weights had
NETWORK_MEMBERS = {MAE_RECIPE: (MAE_NETWORK_MEMBER, ""), DIFFUSION_RECIPE: (DIFFUSION_NETWORK_MEMBER, "model."),
                   SPIRAL_RECIPE: (SPIRAL_NETWORK_MEMBER, "net.")}


def _network_member(checkpoint: dict[str, Any]) -> Optional[str]:
    hparams = checkpoint.get("hyper_parameters")
    if not isinstance(hparams, dict) or "network" in hparams:
        return None
    recipe = hparams.get("_class_path")
    if recipe is None and {"depth", "width", "lr", "betas"} <= set(hparams):  # a spiral built in Python
        recipe = SPIRAL_RECIPE
    if recipe not in NETWORK_MEMBERS:
        return None
    step, old = NETWORK_MEMBERS[recipe]
    network, own = split_settings(recipe, hparams)
    hparams.clear()
    hparams.update(own, network=network)
    _weights_under_network(checkpoint, old)
    return step.name


def renamed_settings_of(class_path: Any) -> dict[str, str]:
    """``{old: new}`` of the settings a network class renamed (its own or its base class's)."""
    if not isinstance(class_path, str):
        return {}
    if class_path in RENAMED_NETWORK_SETTINGS:
        return RENAMED_NETWORK_SETTINGS[class_path]
    try:
        from lightning_mods.backbone._imports import import_path

        cls = import_path(class_path)
    except (ImportError, AttributeError, ValueError):
        return {}
    for base in getattr(cls, "__mro__", ()):
        found = RENAMED_NETWORK_SETTINGS.get(f"{base.__module__}.{base.__qualname__}")
        if found:
            return found
    return {}


def rename_network_settings(tree: Any) -> bool:
    """:data:`MAE_IMG_SIZE`: every ``{"class_path", "init_args"}`` in ``tree`` (a checkpoint's
    hyper-parameters, a saved config) with its network's renamed settings under their new names,
    in place; whether any was renamed."""
    if not isinstance(tree, dict):
        return False
    changed = False
    renamed = renamed_settings_of(tree.get("class_path"))
    init = tree.get("init_args")
    if renamed and isinstance(init, dict) and any(old in init for old in renamed):
        tree["init_args"] = {renamed.get(k, k): v for k, v in init.items()}
        changed = True
    for value in list(tree.values()):
        changed = rename_network_settings(value) or changed
    return changed


def _renamed_network(checkpoint: dict[str, Any]) -> Optional[str]:
    """:data:`CLASSIFIER_NETWORK_NAME`, :data:`FINETUNE_NETWORK_NAME`: the network's settings and
    weights under their new names. The recipe is known by its recorded class path or, built in
    Python (none recorded), by settings only it has."""
    hparams = checkpoint.get("hyper_parameters")
    if not isinstance(hparams, dict) or "network" in hparams:
        return None
    recorded = hparams.get("_class_path")
    for recipe, renamed in RENAMED_NETWORKS.items():
        if not any(old in hparams for old in renamed.settings) or not (
                recorded == recipe or (recorded is None and all(k in hparams for k in renamed.own))):
            continue
        renamed_settings = {renamed.settings.get(k, k): v for k, v in hparams.items()}
        hparams.clear()
        hparams.update(renamed_settings)
        _weights_under_network(checkpoint, renamed.weights)
        return renamed.step.name
    return None


def _weights_under_network(checkpoint: dict[str, Any], old: str) -> None:
    """The weights (and EMA's training weights) whose names start with ``old`` under ``network.``."""
    for field in MODULE_STATES:
        state = checkpoint.get(field)
        if isinstance(state, dict):
            checkpoint[field] = {(f"network.{k[len(old):]}" if k.startswith(old) else k): v for k, v in state.items()}


def effective_rank_history(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:data:`ENTROPY_PROFILE`: EffectiveRank's history, each entry with its ``entropy_profile``."""
    return [{**entry, "entropy_profile": entry.get("entropy_profile") or [float("nan")] * len(entry["profile"])}
            if "profile" in entry else dict(entry) for entry in history]


def older_checkpoint_shortcut_weights(state: dict[str, torch.Tensor], module: nn.Module
                                      ) -> dict[str, torch.Tensor]:
    """:data:`SHORTCUT_WEIGHTS`: ``state`` with ``module``'s shortcut entries where it has none
    (``module`` built from the checkpoint's own settings, so they are the ones that network had)."""
    if any(k.endswith(SHORTCUT_KEY) for k in state):
        return state
    return {**state, **{k: v for k, v in module.state_dict().items() if k.endswith(SHORTCUT_KEY)}}


def rekey_callback_state(checkpoint: dict[str, Any], callback: Any, callbacks: list) -> None:
    """:data:`CALLBACK_STATE_BY_CLASS_NAME`: the state under ``callback``'s class name is its own when
    it is the one instance of its class in ``callbacks``."""
    states = checkpoint.get("callbacks")
    legacy = type(callback).__qualname__
    if not isinstance(states, dict) or callback.state_key in states or legacy not in states:
        return
    if sum(type(other) is type(callback) for other in callbacks) == 1:
        states[callback.state_key] = states[legacy]


def datamodule_state(state: dict[str, Any]) -> dict[str, Optional[dict]]:
    """:data:`DATA_ORDER`: a datamodule's state with ``data_order`` (None where it was not written)."""
    return {"data_order": None, **state}


def steps_due(version: str) -> list[Step]:
    """The steps a release ``version`` (``0.3.0.dev0`` comes before ``0.3.0``) should no longer have."""
    return [step for step in STEPS if Version(version) >= Version(step.dropped_in)]

