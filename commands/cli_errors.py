"""One-line errors of the ``shortcutlab`` command: jsonargparse's nested parse reports, an
unknown class, two callbacks with one ``state_key``, and the innermost cause of any error,
each turned into the single line ``shortcutlab: error: ...`` prints."""
from __future__ import annotations

import difflib
import re
import typing
from typing import Optional

import torch

from commands import _catalogue as catalogue
from lightning_mods.checkpointing.rebuild import canonical_class_path, import_path, init_parameters


class BadInput(ValueError):
    """A setting, file or command line the run cannot use; its message is one line."""


def duplicate_callback_message(err: RuntimeError) -> Optional[BadInput]:
    """Lightning's refusal of two callbacks with one ``state_key`` (a multi-line RuntimeError) as
    one line naming the class and the key; None for any other error."""
    match = re.match(r"Found more than one stateful callback of type `(\w+)`", str(err))
    if not match:
        return None
    return BadInput(f"trainer.callbacks: two {match.group(1)} callbacks have the same settings, so they would "
                    "measure and save the same thing (one state_key); give one other settings or a distinct name")


_PARSER_KEY = re.compile(r'^Parser key "([^"]+)":')


_CLASS_PATH = re.compile(r"^Problem with given class_path '([^']+)'")


_LITERAL = re.compile(r"^Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$")


_TYPE = re.compile(r"^Expected a <class '([^']+)'>\. Got value: (.*)$")


_UNKNOWN_OPTION = re.compile(r"^(?:Option|Group '[^']*' does not accept option|"
                             r"Subcommand '[^']*' does not accept option) '([^']+)'(?: is not accepted)?")


_UNRECOGNISED = re.compile(r"^unrecognized arguments: (\S+)")


_NOT_A_CLASS = re.compile(r"^Expected a dot import path string: (\S+)$")


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def explain_parse_error(err: BaseException, option_names: list[str]) -> str:
    """jsonargparse's nested report -> one line: the full key of the bad field (as written on
    the command line, ``model.init_args.shortcut.init_args.kind``) and the innermost reason.

    jsonargparse chains one exception per level (``Parser key "model"`` -> ``Problem with given
    class_path ...`` -> ``Parser key "shortcut"`` -> ...); its text repeats the report of every
    Union member tried. ``option_names``: the parser's options, for "did you mean".
    """
    keys: list[str] = []
    class_path = None
    messages: list[str] = []
    link: Optional[BaseException] = err
    while link is not None:
        text = str(link).strip()
        if not messages or text != messages[-1]:
            messages.append(text)
            if match := _PARSER_KEY.match(text):
                keys.append(match.group(1))
            elif match := _CLASS_PATH.match(text):
                class_path = match.group(1)
                keys.append("init_args")
        link = link.__cause__ or link.__context__
    innermost = (messages[-1].splitlines() or [type(err).__name__])[0]
    field = ".".join(keys[:-1] if keys and keys[-1] == "init_args" else keys)
    if match := _LITERAL.match(innermost):
        reason = f"must be one of {match.group(1)}; got '{match.group(2)}'"
    elif match := _TYPE.match(innermost):
        kind, value = match.groups()
        finite = " finite" if kind == "float" and value.strip().lower().lstrip("+-") in ("nan", "inf") else ""
        reason = f"must be of type{finite} {kind}; got '{value}'"
    elif match := _UNKNOWN_OPTION.match(innermost):
        bad = ".".join([*keys, match.group(1)])
        if class_path:  # compare the last part only: the shared prefix would make anything "close"
            prefix = ".".join(keys)
            known = sorted(init_parameters(class_path) or [])
            close = difflib.get_close_matches(match.group(1), known, n=1, cutoff=0.6)
            hint = f"; did you mean '{prefix}.{close[0]}'?" if close else ""
            if new := renamed_setting(class_path, match.group(1)):
                hint = (f"; it is {prefix}.{new} since release 0.3 (a saved config: "
                        "lightning_mods.checkpointing.migration.upgrade_model_config rewrites it)")
            if not hint and "network" in known and network_takes(class_path, match.group(1)):  # the network's setting
                hint = (f"; a setting of its network is {prefix}.network.init_args.{match.group(1)} (a config of "
                        "an earlier release: lightning_mods.checkpointing.migration.upgrade_model_config rewrites it)")
            return f"{bad}: unknown key of {class_path}{hint}"
        return f"{bad}: unknown key{_did_you_mean(bad, [o[2:] for o in option_names])}"
    elif match := _UNRECOGNISED.match(innermost):
        option = match.group(1).split("=")[0]
        first, _, rest = option.removeprefix("--").partition(".")
        if class_path and (new := renamed_setting(class_path, first)):  # --model.backbone.X of a recipe
            prefix = ".".join(keys)
            return (f"{prefix}.{first}: unknown key of {class_path}; it is {prefix}.{new} since release 0.3 "
                    f"(--model.{new}{'.' + rest if rest else ''})")
        return f"unknown option '{option}'{_did_you_mean(option, option_names)}"
    elif (match := _NOT_A_CLASS.match(innermost)) and field in ("", *catalogue.KINDS):
        return unknown_class_message(match.group(1), field)
    else:
        reason = innermost[0].lower() + innermost[1:] if innermost[:1].isupper() and field else innermost
    return f"{field}: {reason}" if field else reason


def renamed_setting(recipe_path: str, key: str) -> Optional[str]:
    """The name a setting ``key`` of a recipe or network has had since release 0.3 (the classifier's
    ``backbone``: ``network``; the MAE network's ``image_size``: ``img_size``); None for any other key."""
    from lightning_mods.checkpointing.migration import RENAMED_NETWORKS, renamed_settings_of

    renamed = RENAMED_NETWORKS.get(canonical_class_path(recipe_path))
    return renamed.settings.get(key) if renamed else renamed_settings_of(canonical_class_path(recipe_path)).get(key)


def network_takes(recipe_path: str, key: str) -> bool:
    """Whether a network class named by the ``network`` argument's type of the recipe
    ``recipe_path`` takes the setting ``key`` (True where one takes any setting)."""
    try:
        network = typing.get_type_hints(import_path(recipe_path).__init__).get("network")
    except (ImportError, AttributeError, NameError, TypeError, ValueError):
        return False
    kinds = [kind for kind in (typing.get_args(network) or (network,)) if isinstance(kind, type)
             and kind not in (str, object, torch.nn.Module)]  # any module: nothing known of its settings
    for kind in kinds:
        params = init_parameters(f"{kind.__module__}.{kind.__qualname__}")
        if params is None or key in params:
            return True
    return False


def unknown_class_message(name: str, field: str) -> str:
    """``model: no class 'Nope'; known: DiffusionModule, ...`` (the short names of ``field``'s
    kind, every model and datamodule when the field is unknown, e.g. ``--model.help``)."""
    known = [f.name for kind in ([field] if field else ["model", "data"]) for f in catalogue.find(kind)]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{field + ': ' if field else ''}no class '{name}'; {hint}known: {', '.join(known)} (or a full import path)"


def root_message(err: BaseException) -> str:
    """First line of the innermost cause: jsonargparse wraps a class's own one-line
    ``ValueError`` ("alpha_min must be ...") in multi-line reports of every Union member tried.
    An error raised in a DataLoader worker arrives as "Caught X in DataLoader worker process N"
    plus the worker's traceback: its last line holds the original message."""
    while err.__cause__ is not None and not isinstance(err, BadInput):
        err = err.__cause__
    text = str(err).strip()
    if text.startswith("Caught ") and "Original Traceback" in text:
        last = text.splitlines()[-1]
        return re.sub(r"^[\w.]+(Error|Exception): ", "", last)
    return text.splitlines()[0] if text else type(err).__name__
