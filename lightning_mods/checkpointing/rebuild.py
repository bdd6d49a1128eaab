"""Reading ``shortcutlab fit`` checkpoints back: the network that wrote one, and nothing else.

A Lightning checkpoint written through the CLI carries the module's class
(``hyper_parameters["_class_path"]``), its settings (the other hyper-parameters, the shortcut
schedule included) and its weights, the resolved shortcut weights of every residual block
included (``<block>.shortcut_weights``, see :mod:`lightning_mods.backbone.residual`). So the checkpoint
alone rebuilds the trained network: :func:`module_from_checkpoint`. A setting given on top of it that
disagrees with the checkpoint's is a one-line error naming both values (``allow_override`` builds it).

Files are read with ``torch.load(weights_only=True)``: a checkpoint never runs code.
"""
from __future__ import annotations

import inspect
import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import yaml
from jsonargparse import ArgumentParser, Namespace
from torch import nn

from lightning_mods.backbone._imports import import_path  # noqa: F401 (the one importer; commands import it here)
from lightning_mods.backbone.residual import SHORTCUT_KEY, DecayedResidual
from lightning_mods._compat import lightning_private
from lightning_mods.checkpointing import migration


def read_torch_file(path: str | os.PathLike, field: str, *, noun: str = "torch checkpoint", mmap: bool = False,
                    safe_globals: Sequence[type] = ()) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU, with one-line errors that start with
    ``field``: a missing file (FileNotFoundError) and one the weights-only loader cannot read
    (ValueError, saying why in words: truncated, empty, a pickle that would run code, ...).

    ``mmap`` maps a zip checkpoint instead of reading it (large U-ViT files); ``safe_globals``
    are classes the file may hold besides tensors (the MAE repositories' argparse Namespace).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{field}: no file at {path!r}")
    try:
        with warnings.catch_warnings(), torch.serialization.safe_globals(list(safe_globals)):
            warnings.simplefilter("ignore")  # torch's pickle-protocol notes are not the error
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except Exception as err:  # noqa: BLE001 (torch raises many types for a bad file; all mean the same)
        raise ValueError(f"{field}: {path!r} is not a loadable {noun} ({describe_load_failure(err)})") from None


def describe_load_failure(err: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in words."""
    text = str(err).strip()
    if isinstance(err, pickle.UnpicklingError) and text.startswith("Weights only load failed"):
        if match := re.search(r"Unsupported global: GLOBAL (\S+)", text):
            return f"it refers to {match.group(1)}, which a checkpoint never holds; refused without running it"
        detail = re.search(r"WeightsUnpickler error: ?(.+)", text.replace("\n", " "))
        return "not a torch checkpoint; the weights-only loader refused it" + \
            (f" ({detail.group(1).split('.')[0].strip()})" if detail else "")
    if isinstance(err, EOFError) or not text:
        return "empty or truncated file"
    if "zip archive" in text:
        return "truncated or corrupted zip archive"
    return f"not a torch zip archive or pickle; {type(err).__name__}: {text.splitlines()[0][:200]}"


def unloadable(path: str | os.PathLike) -> Optional[str]:
    """Why the checkpoint at ``path`` cannot be resumed from (truncated, empty, not a Lightning
    checkpoint ...), or None when it loads (read memory-mapped: no full copy in memory)."""
    try:
        ckpt = read_torch_file(path, "checkpoint", mmap=True)
    except (ValueError, FileNotFoundError) as err:
        text = str(err)
        return text.split(" is ", 1)[1] if " is " in text else text  # without the path, said by the caller
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        return "not a Lightning checkpoint (no 'state_dict')"
    return None


def newest_loadable(paths: Sequence[Path], say: Callable[[str], None] = print) -> Optional[Path]:
    """The newest of ``paths`` by modification time (``last.ckpt``, then ``latest.ckpt`` first on
    a tie) that loads; each newer one that does not is skipped with one line through ``say``."""
    preferred = {"last.ckpt": 0, "latest.ckpt": 1}
    for path in sorted(paths, key=lambda p: (-p.stat().st_mtime_ns, preferred.get(p.name, 2), str(p))):
        reason = unloadable(path)
        if reason is None:
            return path
        say(f"skipped {path}: {reason}; trying the next newest checkpoint")
    return None


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A Lightning checkpoint loaded with ``weights_only=True``.

    Raises one-line errors for a missing file, a file that is not a torch checkpoint, and a
    torch file without a ``state_dict``.
    """
    ckpt = read_torch_file(path, "checkpoint")
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise ValueError(f"checkpoint: {os.fspath(path)!r} has no 'state_dict'; expected a Lightning .ckpt written "
                         "by `shortcutlab fit`")
    migration.upgrade(ckpt)
    return ckpt


def load_checkpoint_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of :func:`load_checkpoint`."""
    return load_checkpoint(path)["state_dict"]


def state_dict_mismatch(module: nn.Module, state: dict[str, torch.Tensor]) -> Optional[str]:
    """``None`` when ``state`` loads strictly into ``module`` (same keys and shapes; a standard
    block may lack its shortcut entry), else one line naming the first differing weight."""
    own = module.state_dict()
    optional = {f"{name}.{SHORTCUT_KEY}" if name else SHORTCUT_KEY
                for name, blk in module.named_modules() if isinstance(blk, DecayedResidual) and blk.is_standard()}
    shapes = [k for k in own if k in state and tuple(own[k].shape) != tuple(state[k].shape)]
    if shapes:
        k = shapes[0]
        return (f"{k} is {tuple(state[k].shape)} there and {tuple(own[k].shape)} here "
                f"({len(shapes)} weights differ in shape)")
    missing = [k for k in own if k not in state and k not in optional]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        first = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        return f"{first} ({len(missing)} missing, {len(unexpected)} unexpected)"
    return None


def load_into(module: nn.Module, state: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """``module.load_state_dict(state, strict=True)`` with a one-line error naming the first
    missing, unexpected or differently shaped weight."""
    mismatch = state_dict_mismatch(module, state)
    if mismatch is not None:
        raise ValueError(f"checkpoint: {os.fspath(path)!r} does not fit the {type(module).__name__}: {mismatch}; "
                         "build it with the settings of the run that wrote the checkpoint")
    module.load_state_dict(state, strict=True)


def constructor_parameters(cls: type) -> tuple[dict[str, inspect.Parameter], bool]:
    """The named ``__init__`` parameters of ``cls``, a ``**kwargs`` followed into its base classes
    (a subclass passing them on, as ``examples/mae_l1_loss.py``); and whether a ``**kwargs``
    reaches a framework base, where anything may be accepted."""
    found: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        if klass is object or klass.__module__.startswith(("torch.", "lightning.")):
            return found, True
        params = inspect.signature(klass.__init__).parameters.values()
        for param in params:
            if param.name != "self" and param.kind not in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
                found.setdefault(param.name, param)
        if not any(param.kind is param.VAR_KEYWORD for param in params):
            return found, False
    return found, True


def init_parameters(class_path: str) -> Optional[set[str]]:
    """Names of the ``__init__`` parameters of ``class_path`` (:func:`constructor_parameters`); ``None``
    if any may be accepted, or it cannot be imported."""
    try:
        params, open_ended = constructor_parameters(import_path(class_path))
    except (ImportError, AttributeError, ValueError, TypeError):
        return None
    return None if open_ended else set(params)


def without_class_defaults(value: Any) -> Any:
    """Nested settings without the arguments whose saved value names the very class the
    parameter defaults to (timm's ``embed_layer=PatchEmbed``, saved as its import path or as a
    class_path node): parsed back, jsonargparse would build an instance of it where the network
    expects the class itself."""
    if isinstance(value, list):
        return [without_class_defaults(item) for item in value]
    if not isinstance(value, dict):
        return value
    value = {k: without_class_defaults(v) for k, v in value.items()}
    class_path, init = value.get("class_path"), value.get("init_args")
    if not isinstance(class_path, str) or not isinstance(init, dict):
        return value
    try:
        params, _ = constructor_parameters(import_path(class_path))
    except (ImportError, AttributeError, ValueError, TypeError):
        return value

    def is_class_default(key: str, saved: Any) -> bool:
        default = params[key].default if key in params else None
        saved_path = saved.get("class_path") if isinstance(saved, dict) else saved
        return isinstance(default, type) and isinstance(saved_path, str) \
            and canonical_class_path(saved_path) == f"{default.__module__}.{default.__qualname__}"

    return {**value, "init_args": {k: v for k, v in init.items() if not is_class_default(k, v)}}


def checkpoint_model_config(ckpt: dict[str, Any], path: str | os.PathLike,
                            class_path: Optional[str] = None) -> dict[str, Any]:
    """``{"class_path", "init_args"}`` of the module that wrote ``ckpt``: its ``_class_path``
    (or ``class_path`` for a checkpoint written outside the CLI) and the hyper-parameters its
    ``__init__`` takes (linked values it has no argument for, e.g. an MAE's ``num_classes``, are dropped)."""
    hparams = dict(ckpt.get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    written = hparams.pop("_class_path", None) or class_path
    if written is None:
        raise ValueError(f"checkpoint: {os.fspath(path)!r} does not name its module class (no "
                         "hyper_parameters['_class_path']: not written by `shortcutlab fit`); give the class_path")
    accepted = init_parameters(written)
    if accepted is not None:
        hparams = {k: v for k, v in hparams.items() if k in accepted}
    return without_class_defaults({"class_path": written, "init_args": hparams})


def flat_settings(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"shortcut.alpha_min": 0.6, ...}``: nested settings as dotted leaves; a ``class_path``/
    ``init_args`` node gives ``<node>.class_path`` and its arguments directly under ``<node>``, so
    a schedule written as ``as_dict()`` and one written in LightningCLI's form compare equal."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        if "class_path" in value:
            out[prefix + "class_path"] = canonical_class_path(value["class_path"])
            value = {**(value.get("init_args") or {}), **(value.get("dict_kwargs") or {})}
        for key, item in value.items():
            out.update(flat_settings(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: list(value) if isinstance(value, tuple) else value}


def setting_conflicts(given: dict[str, Any], written: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, given value, written value)`` for every flat setting both have and that differs;
    a given ``None`` means "not set" and never conflicts."""
    return [(k, v, written[k]) for k, v in given.items()
            if k in written and v is not None and v != written[k]]


def conflict_message(conflicts: list[tuple[str, Any, Any]], prefix: str, path: str | os.PathLike,
                     given_word: str = "given") -> str:
    key, given, written = conflicts[0]
    more = f" ({len(conflicts) - 1} more setting(s) differ)" if len(conflicts) > 1 else ""
    return f"{prefix}{key}: {given!r} {given_word}, checkpoint {os.fspath(path)!r} has {written!r}{more}"


def _module_parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(nn.Module, "module", required=True)
    return parser


def _parse(parser: ArgumentParser, config: dict, previous: Optional[Namespace] = None) -> Namespace:
    try:
        return parser.parse_object({"module": config}, previous)
    except Exception as err:  # jsonargparse's multi-line report of every type tried
        missing = unimportable_class(config)
        if missing:
            raise ValueError(f"checkpoint settings: cannot import {missing[0]!r}, a class the checkpoint was written "
                             f"with ({missing[1]}); put its module on PYTHONPATH") from None
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        first = next((line for line in lines if re.search(r"not accepted|unknown|must be", line)), lines[0])
        raise ValueError(f"checkpoint settings: {first}") from None


def canonical_class_path(class_path: Any) -> Any:
    """``module.Class`` where the class is defined: jsonargparse writes the shortest path that
    imports it (``lightning_mods.backbone.ShortcutSchedule``), older files the defining one."""
    if not isinstance(class_path, str) or "." not in class_path:
        return class_path
    try:
        found = import_path(class_path)
    except (ImportError, AttributeError, ValueError):
        return class_path
    return f"{found.__module__}.{found.__qualname__}" if isinstance(found, type) else class_path


def unimportable_class(value: Any) -> Optional[tuple[str, str]]:
    """The first ``class_path`` in nested settings that does not import, and why (else None)."""
    if isinstance(value, dict):
        class_path = value.get("class_path")
        if isinstance(class_path, str) and "." in class_path:
            try:
                import_path(class_path)
            except ImportError as err:
                return class_path, str(err)
            except AttributeError:
                module_name, _, name = class_path.rpartition(".")
                return class_path, f"module {module_name!r} has no {name!r}"
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return next((found for found in map(unimportable_class, value) if found), None)
    return None


def _dump(parser: ArgumentParser, cfg: Namespace) -> dict[str, Any]:
    return yaml.safe_load(parser.dump(cfg, skip_unset=False))["module"]


def _instantiate(parser: ArgumentParser, cfg: Namespace) -> nn.Module:
    """The module of ``cfg``; a LightningModule records the settings as LightningCLI would
    (``_class_path`` + init args), not those of a LightningModule being built around it."""
    config = _dump(parser, cfg)
    hparams = {"_class_path": config["class_path"], **(config.get("init_args") or {})}
    with lightning_private.given_hyperparameters(hparams, instantiator="lightning.pytorch.cli.instantiate_module"):
        return parser.instantiate(cfg).module


def build_module(config: dict) -> tuple[nn.Module, dict[str, Any]]:
    """A module from its LightningCLI ``{"class_path", "init_args"}`` and its resolved settings."""
    parser = _module_parser()
    cfg = _parse(parser, config)
    return _instantiate(parser, cfg), _dump(parser, cfg)


def module_from_checkpoint(path: str | os.PathLike, given: Optional[dict] = None, allow_override: bool = False,
                           name: str = "backbone", ckpt: Optional[dict[str, Any]] = None
                           ) -> tuple[nn.Module, dict[str, Any]]:
    """The network that wrote the checkpoint at ``path``, its weights loaded strictly, and its
    settings ``{"class_path", "init_args"}``.

    ``given`` is an optional ``{"class_path", "init_args"}`` (LightningCLI's form, any subset):
    a value that disagrees with the checkpoint is a one-line ValueError naming both values
    (``name`` prefixes the setting), unless ``allow_override``, which builds with the given
    values (a warning says so), the given shortcut schedule included, and loads the
    checkpoint's other weights. ``ckpt``: the file at ``path``, when the caller has read it.
    """
    ckpt = load_checkpoint(path) if ckpt is None else ckpt
    given = dict(given or {})
    given_class = given.pop("class_path", None)
    config = checkpoint_model_config(ckpt, path, given_class)
    if given_class is not None and canonical_class_path(given_class) != canonical_class_path(config["class_path"]) \
            and not allow_override:
        raise ValueError(conflict_message([("class_path", given_class, config["class_path"])], f"{name}.", path))
    parser = _module_parser()
    cfg = _parse(parser, config if given_class is None else {**config, "class_path": given_class})
    written = _dump(parser, cfg)
    overridden = False
    if given:
        cfg = _parse(parser, given, cfg)
        conflicts = setting_conflicts(flat_settings(_dump(parser, cfg)), flat_settings(written))
        if given_class is not None and canonical_class_path(given_class) != canonical_class_path(config["class_path"]):
            conflicts.insert(0, ("class_path", given_class, config["class_path"]))
        if conflicts and not allow_override:
            raise ValueError(conflict_message(conflicts, f"{name}.", path)
                             + "; drop the setting to use the checkpoint's, or set allow_override")
        if conflicts:
            overridden = True
            warnings.warn(conflict_message(conflicts, f"{name}.", path) + "; allow_override: building "
                          "with the given settings and the checkpoint's weights", stacklevel=2)
    module = _instantiate(parser, cfg)
    state = ckpt["state_dict"]
    own_entries = {k: v for k, v in module.state_dict().items() if k.endswith(SHORTCUT_KEY)}
    if overridden:
        # the given settings, the checkpoint's weights: its shortcut entries would undo a given schedule
        state = {**{k: v for k, v in state.items() if not k.endswith(SHORTCUT_KEY)}, **own_entries}
    else:
        state = migration.older_checkpoint_shortcut_weights(state, module)
    load_into(module, state, path)
    return module, _dump(parser, cfg)


def datamodule_settings(ckpt: dict[str, Any]) -> Optional[dict[str, Any]]:
    """``{"class_path", "init_args"}`` of the datamodule a checkpoint's run trained on (its
    ``datamodule_hyper_parameters``), or None when the checkpoint names none."""
    saved = dict(ckpt.get("datamodule_hyper_parameters") or {})
    class_path = saved.get("_class_path")
    if not class_path:
        return None
    return {"class_path": class_path, "init_args": {k: v for k, v in saved.items() if not k.startswith("_")}}


def load_run(path: str | os.PathLike, model: Optional[dict] = None, allow_override: bool = False,
             data: Optional[dict[str, Any]] = None, with_data: bool = True,
             ckpt: Optional[dict[str, Any]] = None, *, allow_model_override: Optional[bool] = None
             ) -> tuple[nn.Module, Optional[Any]]:
    """The run that wrote the checkpoint at ``path``: ``(module, datamodule)``.

    - ``module``: the network that wrote it, weights loaded strictly (:func:`module_from_checkpoint`;
      ``model`` and ``allow_override`` as its ``given`` and ``allow_override``).
    - ``datamodule``: the run's datamodule rebuilt from the settings the checkpoint holds, with
      ``data`` (settings by name, e.g. ``{"data_dir": "/data/cifar"}``) on top; not set up. None
      when ``with_data`` is false or the checkpoint names no datamodule (written outside the CLI).

    ``ckpt``: the checkpoint at ``path`` when the caller has read it already; ``allow_model_override``:
    ``allow_override``'s name before release 0.3 (taken with a FutureWarning)."""
    if allow_model_override is not None:
        warnings.warn("load_run: allow_model_override is allow_override since release 0.3", FutureWarning, 2)
        allow_override = allow_model_override
    ckpt = load_checkpoint(path) if ckpt is None else ckpt
    module, _ = module_from_checkpoint(path, model, allow_override, name="model", ckpt=ckpt)
    written = datamodule_settings(ckpt) if with_data else None
    if written is None:
        return module, None
    cls = import_path(written["class_path"])
    settings = {**written["init_args"], **dict(data or {})}
    try:
        return module, cls(**settings)
    except TypeError as err:
        raise ValueError(f"data: {cls.__name__} of {os.fspath(path)!r}: {err}") from None
