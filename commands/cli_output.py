"""What the ``shortcutlab`` command prints.

- **One-line errors.** A bad setting, file or command line ends with the single line
  ``shortcutlab: error: ...``: jsonargparse's nested parse reports (the full key and the innermost
  reason, "did you mean", the new name of a renamed key), an unknown class (the known ones), two
  callbacks with one ``state_key``, and the innermost cause of any other error.
- **Its own lines, not the libraries'.** Lightning's info lines go to stdout (stderr holds warnings
  and errors); third-party lines that concern neither the run nor the user's settings are
  filtered by exact message; Lightning's warnings that contradict what the package makes exact
  (frozen modules in eval mode, repeated DDP evaluation samples, a mid-epoch resume) are answered
  for the runs they do not apply to; bf16 on a CPU without native bf16 gets a warning.
"""
from __future__ import annotations

import difflib
import logging
import re
import sys
import typing
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from commands import _catalogue as catalogue
from lightning_mods._compat import lightning_private
from lightning_mods.checkpointing.rebuild import canonical_class_path, import_path, init_parameters


# --- one-line errors -----------------------------------------------------------------------------
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


def config_syntax_error(args: Optional[list[str]]) -> Optional[str]:
    """The one line naming the ``--config`` file of ``args`` that is not valid YAML, with the line and
    column where the parser stopped (jsonargparse reads the file's text, so its own report names
    neither); None when every config file parses (or none is given)."""
    import yaml

    words = list(sys.argv[1:] if args is None else args)
    for i, word in enumerate(words):
        name, has_value, value = word.partition("=")
        path = value if has_value else (words[i + 1] if i + 1 < len(words) else "")
        if name != "--config" or not path or path.lstrip().startswith("{"):
            continue
        try:
            with open(path) as f:
                yaml.safe_load(f)
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = " ".join(filter(None, [err.context, err.problem]))
            return f"{path}{where}: not valid YAML ({problem})"
        except (OSError, yaml.YAMLError):
            continue
    return None


def union_types(messages: list[str], kind: str) -> str:
    """``"bool or int"`` when jsonargparse's report tried ``kind`` as one type of a Union, else ``kind``."""
    union = next((m.group(1) for text in messages if (m := re.search(r"Subtypes: \[(.*?)\]", text))), "")
    kinds = [k for k in re.findall(r"<class '(\w+)'>", union) if k != "NoneType"]
    return " or ".join(kinds) if kind in kinds else kind


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
        kind = union_types(messages, kind)
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
                        "lightning_mods.checkpointing.migration.upgrade_config rewrites it)")
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
    from lightning_mods.checkpointing.migration import (PROBE_SETTINGS, RENAMED_NETWORKS, RENAMED_RECIPE_SETTINGS,
                                                        renamed_settings_of)

    path = canonical_class_path(recipe_path)
    if path.endswith(".OnlineLinearProbe"):
        return PROBE_SETTINGS.get(key)
    if key in RENAMED_RECIPE_SETTINGS.get(path, {}):
        return RENAMED_RECIPE_SETTINGS[path][key]
    renamed = RENAMED_NETWORKS.get(path)
    return renamed.settings.get(key) if renamed else renamed_settings_of(path).get(key)


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


# --- what a run prints ----------------------------------------------------------------------------
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has AMX tiles for bf16 matmuls (Linux ``/proc/cpuinfo`` flag).

    AVX512-BF16 alone is not enough: on the 2-core reference machine, which has it, bf16 ran
    from 0.7x to ~24x the fp32 time depending on the torch build and the model
    (``benchmarks/bf16_cpu.py``; numbers in docs/performance.md).
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


def info_logs_to_stdout() -> None:
    """Lightning's info lines ("Seed set to 0", "GPU available") go to stdout, so stderr holds
    only warnings and errors (and a bad input, one line)."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
                handler.setStream(sys.stdout)


# Third-party output that says nothing about the run, silenced by exact message (and, for
# warnings, category and emitting module), so that any other message still shows:
LIGHTNING_INFO_NOISE = (
    # advertisements for Lightning's cloud services, on every fit
    r"^💡 Tip: For seamless cloud (logging and experiment tracking|uploads and versioning), try installing",
    # our configs list RichModelSummary on purpose; Lightning reports that it adds no default summary
    r"^Trainer already configured with model summary callbacks: ",
    # our recipes size their schedules with trainer.estimated_stepping_batches; an internal step
    r"^Loading `train_dataloader` to estimate number of stepping batches\.$",
)


class _DropMessages(logging.Filter):
    """Drops log records whose message matches one of ``patterns``."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p.search(record.getMessage()) for p in self.patterns)


_LIGHTNING_INFO_FILTER = _DropMessages(LIGHTNING_INFO_NOISE)


def silence_third_party_noise() -> None:
    """Filter the third-party lines every fit printed that concern neither the run nor the user's
    settings. Idempotent."""
    # rank_zero_info's records are created on this logger (lightning.pytorch.utilities.rank_zero)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_LIGHTNING_INFO_FILTER)
    # torch 2.15 deprecated LeafSpec; Lightning 2.6's own _pytree helper still builds one per
    # batch it flattens: nothing a user of shortcutlab can change
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")


def frozen_eval_mode_count(model: torch.nn.Module) -> Optional[int]:
    """The number of modules in eval mode (Lightning's count, root included) when every one of
    them lies in a frozen subtree (a module in eval mode with parameters, none of them
    trainable: the LinearProbe's backbone); ``None`` when there are none, or when any other
    module is in eval mode."""
    frozen: set[int] = set()
    for module in model.modules():
        params = list(module.parameters())
        if not module.training and params and not any(p.requires_grad for p in params):
            frozen.update(id(sub) for sub in module.modules())
    in_eval = [module for _, module in model.named_modules() if not module.training]
    if not in_eval or any(id(module) not in frozen for module in in_eval):
        return None
    return len(in_eval)


def expect_frozen_eval_modules(model: torch.nn.Module) -> None:
    """Silence Lightning's "Found N module(s) in eval mode at the start of training" when the N
    are exactly the model's intentionally frozen modules (:func:`frozen_eval_mode_count`): a
    module left in eval mode by mistake changes N, and the warning shows."""
    count = frozen_eval_mode_count(model)
    if count is not None:
        warnings.filterwarnings("ignore", message=rf"Found {count} module\(s\) in eval mode at the start of training",
                                category=PossibleUserWarning, module=r"lightning\.pytorch\.loops\.fit_loop")


def answer_repeated_samples_warning(model: torch.nn.Module) -> None:
    """Lightning warns that a DDP ``validate``/``test`` evaluates some samples twice (its
    ``DistributedSampler`` evens out the ranks). A model that leaves those repeats out
    (:class:`lightning_mods.evaluation._distributed_eval.ExactEvaluation`) reports the one-process
    numbers, so the warning does not apply to it; any other model still gets it."""
    from lightning_mods.evaluation._distributed_eval import ExactEvaluation

    if isinstance(model, ExactEvaluation):
        warnings.filterwarnings("ignore", message=r"Using `DistributedSampler` with the dataloaders\. During "
                                r"`trainer\.(validate|test)\(\)`", category=PossibleUserWarning)


def answer_resume_warnings(trainer: Any, subcommand: str, ckpt_path: Optional[str]) -> None:
    """Lightning's warnings that contradict what the package makes exact: a mid-epoch resume of a
    fit that carries ``ExactResume`` continues its data where it stopped (the warning says the
    dataloader is not resumable), and ``validate``/``test``/``predict`` of a checkpoint save no
    checkpoint, so the ModelCheckpoint folder they would use does not matter ("The dirpath has
    changed"). Any other run still gets both."""
    if not ckpt_path:
        return
    from callbacks.reliability.exact_resume import ExactResume

    if subcommand == "fit" and any(isinstance(cb, ExactResume) for cb in trainer.callbacks):
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch "
                                r"ended and your dataloader is not resumable")
    if subcommand in ("validate", "test", "predict"):
        warnings.filterwarnings("ignore", message=r"The dirpath has changed from")


def answer_folder_warnings(trainer: Any, subcommand: str, ckpt_path: Optional[str]) -> None:
    """Lightning's "exists and is not empty" warnings where nothing is lost: a CSV logger's folder
    that holds no ``metrics.csv`` (the only file the logger deletes; a sweep's run folder holds its
    ``run.yaml`` and log, a resumed fit has set its metrics aside to put them back), and, when a fit
    resumes, the folder of the checkpoint it resumes from. Call it once the loggers' versions are
    set (:func:`commands.cli_checkpoint.continue_logger_versions`)."""
    for logger in trainer.loggers:  # an unversioned one takes a new folder: its version is not read early
        if (isinstance(logger, CSVLogger) and lightning_private.logger_version_given(logger)
                and not (Path(logger.log_dir) / "metrics.csv").exists()):
            warnings.filterwarnings("ignore", message=re.escape(f"Experiment logs directory {logger.log_dir} exists "
                                                                "and is not empty"))
    if subcommand == "fit" and ckpt_path:
        folders = {str(Path(ckpt_path).parent), str(Path(ckpt_path).resolve().parent)}
        warnings.filterwarnings("ignore", message="|".join(re.escape(f"Checkpoint directory {folder} exists and is not "
                                                                     "empty") for folder in folders))
