"""What a recipe records of the network it holds, so that its checkpoint rebuilds that network:
the network's class and its ``settings`` (every constructor argument, resolved, as plain data)."""
from __future__ import annotations

import os
from typing import Any, Optional

from torch import nn

from lightning_mods.checkpointing.rebuild import (canonical_class_path, conflict_message, constructor_parameters,
                                                  import_path, load_checkpoint, module_from_checkpoint)


def network_settings(network: nn.Module) -> dict[str, Any]:
    """``{"class_path", "init_args"}`` of ``network``: its class and its ``settings``.

    A one-line ValueError when it has no ``settings`` dict, or when its class takes an argument
    the settings leave out (a subclass's own argument: rebuilt without it, the network would be
    another one)."""
    cls = type(network)
    settings = getattr(network, "settings", None)
    if not isinstance(settings, dict):
        raise ValueError(f"network: {cls.__name__} has no settings dict (its constructor arguments as plain data), "
                         "which a checkpoint records to rebuild it")
    params, _ = constructor_parameters(cls)
    left_out = [name for name in params if name not in settings]
    if left_out:
        raise ValueError(f"network: {cls.__name__} takes {', '.join(left_out)}, which its settings do not record; "
                         f"add {'them' if len(left_out) > 1 else 'it'} to self.settings so a checkpoint rebuilds "
                         "the same network")
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": dict(settings)}


def given_network(network: nn.Module | str, expected: type, owner: str, example: str) -> nn.Module:
    """The network a recipe is given: a module as it is, a name of timm's registry built by timm;
    a one-line ValueError unless it is an ``expected`` (``example``: a registered name to suggest)."""
    if isinstance(network, str):
        import timm

        network = timm.create_model(network)
    if not isinstance(network, expected):
        raise ValueError(f"{owner}: network must be a {expected.__name__} (or a subclass, or the timm name of one, "
                         f"e.g. {example}); got {type(network).__name__}")
    return network


def network_of(module: nn.Module) -> nn.Module:
    """What an evaluation of a checkpoint reads: the network a recipe holds (its ``network``) where
    the recipe says its features are the network's (``network_is_evaluated``), else ``module``."""
    network = getattr(module, "network", None)
    return network if isinstance(network, nn.Module) and network_is_evaluated(type(module)) else module


def network_is_evaluated(recipe: Any) -> bool:
    """Whether ``recipe`` (a class, or its import path) says the evaluations read its network alone."""
    try:
        cls = import_path(canonical_class_path(recipe)) if isinstance(recipe, str) else recipe
    except (ImportError, AttributeError, ValueError):
        return False
    return bool(getattr(cls, "network_is_evaluated", False))


def network_config(module: nn.Module, config: dict[str, Any]) -> dict[str, Any]:
    """The settings of :func:`network_of` ``(module)``: the recipe's ``network`` entry of ``config``
    (its ``{"class_path", "init_args"}``), or ``config`` itself."""
    network = (config.get("init_args") or {}).get("network")
    return network if network_of(module) is not module and isinstance(network, dict) else config


def load_network(path: str | os.PathLike, given: Optional[dict] = None, allow_override: bool = False,
                 name: str = "backbone") -> tuple[nn.Module, dict[str, Any]]:
    """The network a checkpoint holds, and its settings: built alone from the recipe's recorded
    ``network`` and loaded strictly with the recipe's ``network.*`` weights (nothing else of the
    recipe is built). A recipe that records no ``network`` (the classifier, the diffusion model)
    is rebuilt whole, as :func:`~lightning_mods.checkpointing.rebuild.module_from_checkpoint` does.

    ``given``: the network's settings (or the recipe's, its ``network`` entry holding the network's),
    checked against the checkpoint; ``allow_override`` and ``name`` as ``module_from_checkpoint``'s."""
    ckpt = load_checkpoint(path)
    hparams = ckpt.get("hyper_parameters") or {}
    network = hparams.get("network")
    if not isinstance(network, dict) or not network.get("class_path") or \
            not network_is_evaluated(hparams.get("_class_path")):
        return module_from_checkpoint(path, given, allow_override, name=name, ckpt=ckpt)
    given = dict(given or {})
    nested = (given.get("init_args") or {}).get("network")
    if isinstance(nested, dict):  # the recipe's form: its class, and its network's settings
        recipe = given.get("class_path")
        if recipe and canonical_class_path(recipe) != canonical_class_path(hparams.get("_class_path")):
            raise ValueError(conflict_message([("class_path", recipe, hparams.get("_class_path"))], f"{name}.", path))
        given = nested
    alone = {"hyper_parameters": {"_class_path": network["class_path"], **(network.get("init_args") or {})},
             "state_dict": {k[len("network."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("network.")}}
    return module_from_checkpoint(path, given or None, allow_override, name=name, ckpt=alone)
