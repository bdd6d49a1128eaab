"""shortcutlab command line: a LightningCLI (``fit``, ``validate``, ``test``, ``predict``).

    shortcutlab fit --config configs/digits_mae.yaml
    python cli.py validate --config configs/digits_mae.yaml --ckpt_path runs/.../last.ckpt

Values that data and model must agree on (image size, channels, number of classes) are
linked from the datamodule to the model; a model that has no such argument ignores the link.
"""
from __future__ import annotations

import difflib
import importlib
import logging
import os
import pickle
import re
import signal
import sys
import warnings
import zipfile
from argparse import ArgumentError
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from jsonargparse.typing import PositiveInt
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI, _InstantiatorFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from callbacks.bad_input_cleanup import RemoveLogsOnBadInput
from callbacks.prediction_writer import PredictionWriter

from callbacks.nonfinite_guard import NonFiniteTrainingError
from callbacks.preemption import received_signal
from callbacks.schedule import ScheduledEvaluation

from lightning_mods.checkpoint import (checkpoint_model_config, conflict_message, flat_settings, init_parameters,
                                       load_checkpoint, setting_conflicts, state_dict_mismatch)

LINKED_FROM_DATA = ("image_size", "in_chans", "num_classes")
DEFAULT_CALLBACKS = [
    {"class_path": "lightning.pytorch.callbacks.RichProgressBar"},
    {"class_path": "lightning.pytorch.callbacks.RichModelSummary", "init_args": {"max_depth": 2}},
    # reliability (README "Reliability"); a config's callback list replaces these, so each
    # shipped config names them too
    {"class_path": "callbacks.exact_resume.ExactResume"},
    {"class_path": "callbacks.nonfinite_guard.NonFiniteGuard"},
    {"class_path": "callbacks.preemption.PreemptionCheckpoint"},
]
DIVERGED_EXIT_STATUS = 3


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has AMX tiles for bf16 matmuls (Linux ``/proc/cpuinfo`` flag).

    AVX512-BF16 alone is not enough: on the 2-core reference machine, which has it, bf16 ran
    from 0.7x to ~24x the fp32 time depending on the torch build and the model
    (``benchmarks/bf16_cpu.py``; numbers in the README).
    """
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False


def warn_on_slow_precision(precision: Optional[str], accelerator: Optional[str]) -> None:
    """Warn that bf16 on a CPU without AMX has no reliable speed-up and can be far slower."""
    on_cpu = accelerator == "cpu" or (accelerator in (None, "auto") and not torch.cuda.is_available())
    if precision is not None and "bf16" in str(precision) and on_cpu and not cpu_has_native_bf16():
        warnings.warn(
            f"trainer.precision={precision!r} on a CPU without native bf16 (AMX): no reliable "
            "speed-up over fp32 (0.7x to ~24x its time on the reference 2-core machine, by torch "
            "build and model; run benchmarks/bf16_cpu.py here); use precision=32-true on this CPU.",
            stacklevel=2,
        )


def _class_path(callback) -> str:  # noqa: ANN001 (Namespace, dict or instance)
    if isinstance(callback, dict) or hasattr(callback, "get"):
        return callback.get("class_path", "")
    return type(callback).__name__


class _TopLevelModelHyperparameters(_InstantiatorFn):
    """Lightning's instantiator that hands the config to ``save_hyperparameters``, applied to
    the top-level model only.

    Lightning registers it for every LightningModule subclass, so a LightningModule nested in
    the model's ``init_args`` (the LinearProbe's ``backbone``) would record the top-level
    model's hyper-parameters instead of its own.
    """

    def __init__(self, cli: LightningCLI) -> None:
        super().__init__(cli=cli, key="model")

    def __call__(self, class_type: type, *args: Any, applied_instantiation_links: dict, **kwargs: Any) -> Any:
        self.cli._dump_config()
        top = (self.cli.config_dump.get("model") or {}).get("class_path")
        if top == f"{class_type.__module__}.{class_type.__qualname__}":
            return super().__call__(class_type, *args, applied_instantiation_links=applied_instantiation_links,
                                    **kwargs)
        return class_type(*args, **kwargs)


class ShortcutLabCLI(LightningCLI):
    """LightningCLI with the data -> model links and the default callbacks."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 (jsonargparse parser)
        for name in LINKED_FROM_DATA:
            parser.link_arguments(
                "data", f"model.init_args.{name}", compute_fn=lambda data, name=name: getattr(data, name, None),
                apply_on="instantiate",
            )
        # set_defaults (not trainer_defaults) keeps these replaceable from YAML
        parser.set_defaults({"trainer.callbacks": DEFAULT_CALLBACKS})
        parser.add_argument("--evaluation_every_n_epochs", type=Optional[PositiveInt], default=None,
                            help="every_n_epochs of the evaluation callbacks in trainer.callbacks (kNN, "
                                 "effective rank, FID); null: as the config says")
        parser.add_argument("--checkpoint_every_n_epochs", type=Optional[PositiveInt], default=None,
                            help="every_n_epochs of the ModelCheckpoint callbacks in trainer.callbacks "
                                 "except the every-epoch resume point (filename 'latest'); null: as the config says")

    def _add_instantiators(self) -> None:
        super()._add_instantiators()
        self.parser.add_instantiator(_TopLevelModelHyperparameters(self), LightningModule, subclasses=True,
                                     prepend=True)

    def parse_arguments(self, parser, args) -> None:  # noqa: ANN001 (jsonargparse parser, args)
        """Lightning's parsing; with raising parsers (``console_main``) a parse error becomes one
        :class:`BadInput` line, and ``ckpt_path`` is checked before anything reads it."""
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            raise BadInput(explain_parse_error(err, self.option_names(args))) from err
        subcommand = self.config.get("subcommand")
        # read once here; _parse_ckpt_path uses it (checkpoints of large models are gigabytes)
        self._checked_ckpt = check_ckpt_path(self.config[subcommand].get("ckpt_path")) if subcommand else None

    def option_names(self, args: Optional[list[str]]) -> list[str]:
        """The ``--options`` of the subcommand named in ``args`` (``sys.argv`` when None)."""
        words = sys.argv[1:] if args is None else [str(a) for a in args]
        subcommand = next((w for w in words if w in getattr(self, "_subcommand_parsers", {})), None)
        parser = self._subcommand_parsers[subcommand] if subcommand else self.parser
        return [o for o in parser._option_string_actions if o.startswith("--")]

    def _parse_ckpt_path(self) -> None:
        """The model is the network that wrote ``--ckpt_path``: Lightning's version (the
        checkpoint's hyper-parameters rebuild the model, those its ``__init__`` does not take
        dropped), refusing a checkpoint of another class or with other settings.

        A model class or setting of the config that disagrees with the checkpoint is a one-line
        ValueError naming both values (nothing is built, nothing trains); values linked from the
        data are checked as weight shapes once the model is built (:meth:`instantiate_classes`).
        """
        self._ckpt_weights: Optional[tuple[str, dict]] = None
        if not self.config.get("subcommand"):
            return
        subcommand = self.config.subcommand
        ckpt_path = self.config[subcommand].get("ckpt_path")
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        ckpt = getattr(self, "_checked_ckpt", None) or load_checkpoint(ckpt_path)
        self._checked_ckpt = None
        if "_class_path" not in (ckpt.get("hyper_parameters") or {}):
            return super()._parse_ckpt_path()
        written = checkpoint_model_config(ckpt, ckpt_path)
        given = yaml.safe_load(self.parser.dump(self.config, skip_link_targets=False, skip_none=False))
        given = (given.get(subcommand) or {}).get("model") or {}
        if given.get("class_path") != written["class_path"]:
            raise ValueError(f"--ckpt_path: {ckpt_path!r} is a checkpoint of {written['class_path']}, the model is "
                             f"{given.get('class_path')}; give the config the checkpoint was trained with")
        settings = {k: v for k, v in flat_settings(given).items() if k.split(".")[0] not in LINKED_FROM_DATA}
        conflicts = setting_conflicts(settings, flat_settings(written))
        if conflicts:
            raise ValueError(conflict_message(conflicts, "--ckpt_path: model.", ckpt_path, "in the config")
                             + "; the checkpoint's network is rebuilt from its own settings: drop or match them")
        self._ckpt_weights = (ckpt_path, {k: v for k, v in ckpt["state_dict"].items() if isinstance(v, torch.Tensor)})
        model = {"class_path": written["class_path"], "dict_kwargs": written["init_args"]}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": model}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        if getattr(self, "_ckpt_weights", None) is not None:
            # links from the data (image size, channels, classes) can still give other shapes
            ckpt_path, state = self._ckpt_weights
            self._ckpt_weights = None
            mismatch = state_dict_mismatch(self.model, state)
            if mismatch is not None:
                raise ValueError(f"--ckpt_path: {ckpt_path!r} does not fit the model: {mismatch}; give the config "
                                 "(data included) the checkpoint was trained with")

    def before_instantiate_classes(self) -> None:
        cfg = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        trainer_cfg = cfg.get("trainer", {})
        warn_on_slow_precision(trainer_cfg.get("precision"), trainer_cfg.get("accelerator"))
        apply_cadences(trainer_cfg.get("callbacks") or [], cfg.get("evaluation_every_n_epochs"),
                       cfg.get("checkpoint_every_n_epochs"))
        if trainer_cfg.get("enable_progress_bar") is False and trainer_cfg.get("callbacks"):
            # honour enable_progress_bar=false instead of failing on the default Rich bar
            trainer_cfg["callbacks"] = [c for c in trainer_cfg["callbacks"]
                                        if not str(_class_path(c)).endswith("ProgressBar")]

    def after_instantiate_classes(self) -> None:
        self.trainer.callbacks.append(RemoveLogsOnBadInput(self.trainer))
        if self.subcommand == "predict":
            add_prediction_writer(self.trainer)


def apply_cadences(callbacks: list, evaluation_every: Optional[int], checkpoint_every: Optional[int]) -> None:
    """The top-level cadence knobs: ``evaluation_every`` into the evaluation callbacks
    (:class:`callbacks.schedule.ScheduledEvaluation`), ``checkpoint_every`` into the ModelCheckpoint
    callbacks but the every-epoch ``latest`` one (parsed ``class_path``/``init_args`` entries,
    changed in place; None leaves a cadence as configured)."""
    for callback in callbacks:
        if not hasattr(callback, "get") or callback.get("init_args") is None:
            continue
        module, _, name = str(callback.get("class_path", "")).rpartition(".")
        cls, init = getattr(importlib.import_module(module), name, None) if module else None, callback["init_args"]
        if not isinstance(cls, type):
            continue
        if evaluation_every is not None and issubclass(cls, ScheduledEvaluation):
            init["every_n_epochs"] = int(evaluation_every)  # a plain int: PositiveInt does not dump to YAML
        if checkpoint_every is not None and issubclass(cls, ModelCheckpoint) and init.get("filename") != "latest":
            init["every_n_epochs"] = int(checkpoint_every)


def add_prediction_writer(trainer) -> None:  # noqa: ANN001 (Trainer)
    """``predict`` saves its outputs (``callbacks/prediction_writer.py``) unless a writer is configured."""
    if not any(isinstance(callback, BasePredictionWriter) for callback in trainer.callbacks):
        trainer.callbacks.append(PredictionWriter())


def main(args: Optional[list[str]] = None, parser_kwargs: Optional[dict[str, Any]] = None) -> ShortcutLabCLI:
    """Run the CLI on ``args`` (``sys.argv`` when None) and return it (trainer, model, data)."""
    return ShortcutLabCLI(
        LightningModule, LightningDataModule,
        subclass_mode_model=True, subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs=parser_kwargs,
        args=args,
    )


class BadInput(ValueError):
    """A setting, file or command line the run cannot use; its message is one line."""


LIGHTNING_CKPT_ALIASES = ("best", "last", "hpc", "registry")


def check_ckpt_path(ckpt_path: Optional[str]) -> Optional[dict]:
    """The checkpoint at ``ckpt_path``, or a one-line error unless it is a Lightning checkpoint
    ``torch.load`` reads with ``weights_only`` (a pickle that would run code is refused unread);
    Lightning's aliases (``last``, ``best``, ...) and URLs are left to Lightning (``None``)."""
    if not ckpt_path or str(ckpt_path).split(":")[0] in LIGHTNING_CKPT_ALIASES or "://" in str(ckpt_path):
        return None
    if not os.path.isfile(ckpt_path):
        raise BadInput(f"ckpt_path: no file '{ckpt_path}'")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's pickle-protocol notes are not the error
            ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(ckpt_path))
    except Exception as err:  # noqa: BLE001 (torch raises many types for a bad file; all mean the same)
        raise BadInput(f"ckpt_path: '{ckpt_path}' is not a loadable torch checkpoint ({_load_failure(err)})") \
            from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise BadInput(f"ckpt_path: '{ckpt_path}' is a torch file but not a Lightning checkpoint (no 'state_dict')")
    return ckpt


def _load_failure(err: Exception) -> str:
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


_PARSER_KEY = re.compile(r'^Parser key "([^"]+)":')
_CLASS_PATH = re.compile(r"^Problem with given class_path '([^']+)'")
_LITERAL = re.compile(r"^Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$")
_TYPE = re.compile(r"^Expected a <class '([^']+)'>\. Got value: (.*)$")
_UNKNOWN_OPTION = re.compile(r"^(?:Option|Group '[^']*' does not accept option|"
                             r"Subcommand '[^']*' does not accept option) '([^']+)'(?: is not accepted)?")
_UNRECOGNISED = re.compile(r"^unrecognized arguments: (\S+)")


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
            return f"{bad}: unknown key of {class_path}{hint}"
        return f"{bad}: unknown key{_did_you_mean(bad, [o[2:] for o in option_names])}"
    elif match := _UNRECOGNISED.match(innermost):
        option = match.group(1).split("=")[0]
        return f"unknown option '{option}'{_did_you_mean(option, option_names)}"
    else:
        reason = innermost[0].lower() + innermost[1:] if innermost[:1].isupper() and field else innermost
    return f"{field}: {reason}" if field else reason


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


def run_reporting_stops(args: Optional[list[str]] = None, **main_kwargs: Any) -> None:
    """``main``, with the exit statuses of a stopped fit: a divergence (one line, status 3) and a
    pre-emption (``128 + signal``: 143 for SIGTERM, 130 for SIGINT; callbacks/preemption.py)."""
    try:
        main(args, **main_kwargs)
    except NonFiniteTrainingError as err:
        if os.environ.get("SHORTCUTLAB_TRACEBACK"):
            raise
        print(f"shortcutlab: error: {err}", file=sys.stderr)
        sys.exit(DIVERGED_EXIT_STATUS)
    except SIGTERMException:
        sys.exit(128 + (received_signal() or signal.SIGTERM))


def raising_parsers() -> dict[str, Any]:
    """``parser_kwargs`` under which jsonargparse raises its errors instead of printing usage."""
    return {"exit_on_error": False, **{name: {"exit_on_error": False} for name in ShortcutLabCLI.subcommands()}}


def info_logs_to_stdout() -> None:
    """Lightning's info lines ("Seed set to 0", "GPU available") go to stdout, so stderr holds
    only warnings and errors (and a bad input, one line)."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
                handler.setStream(sys.stdout)


def console_main() -> None:
    """The ``shortcutlab`` console command (returns None: a console script exits with its value).

    A bad setting or a missing file ends with one line on stderr and exit status 2;
    ``SHORTCUTLAB_TRACEBACK=1`` shows the traceback instead.
    """
    info_logs_to_stdout()
    try:
        run_reporting_stops(parser_kwargs=raising_parsers())
    except (ValueError, FileNotFoundError, MisconfigurationException) as err:
        if os.environ.get("SHORTCUTLAB_TRACEBACK"):
            raise
        print(f"shortcutlab: error: {root_message(err)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    console_main()
