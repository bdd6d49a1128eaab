"""shortcutlab command line: a LightningCLI (``fit``, ``validate``, ``test``, ``predict``).

    shortcutlab fit --config configs/digits_mae.yaml
    python cli.py validate --config configs/digits_mae.yaml --ckpt_path runs/.../last.ckpt

Values that data and model must agree on (image size, channels, number of classes) are
linked from the datamodule to the model (and set in the network a recipe is given, ``model.init_args.network``);
a model that has no such argument ignores the link.
The settings every run gets are :mod:`commands.cli_settings`, the checkpoint a command is given
:mod:`commands.cli_checkpoint`, and what the command prints (its one-line errors included)
:mod:`commands.cli_output`.

Built on LightningCLI's public hooks (``init_parser``, ``add_arguments_to_parser``,
``parse_arguments``, ``before_instantiate_classes``, ``after_instantiate_classes``,
``after_fit``) but one private step, replaced through
:mod:`lightning_mods._compat.lightning_private` (with the Lightning releases it was tested on):
see :meth:`ShortcutLabCLI.check_ckpt_path_against_config`.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import warnings
from argparse import ArgumentError
from pathlib import Path
from typing import Any, Optional

from jsonargparse.typing import PositiveInt
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

import lightning_mods.exit_statuses as exit_statuses
from commands import _catalogue as catalogue
from commands import reproducible_cpu
from commands.cli_settings import (CKPT_PATH_HELP, DATA_NAMES, DEFAULT_CALLBACKS, LINKED_FROM_DATA,
                                   add_prediction_writer, add_required_callbacks, apply_cadences, component_name,
                                   describe_component, fill_network_from_data, is_progress_bar, linked_settings_given,
                                   network_by_name)
from commands._run_config import RunConfig
from commands.cli_checkpoint import (check_ckpt_path, check_weights_fit, continue_logger_versions, merge_kept_metrics,
                                     model_of_checkpoint, resolve_auto_ckpt_path, resolve_folder_ckpt_path)
from commands.cli_output import (BadInput, answer_folder_warnings, answer_repeated_samples_warning,
                                 answer_resume_warnings, config_syntax_error, duplicate_callback_message,
                                 expect_frozen_eval_modules, explain_parse_error, info_logs_to_stdout, root_message,
                                 silence_third_party_noise, warn_on_slow_precision)
from callbacks.reliability import lost_rank
from callbacks.reliability.nonfinite_guard import NonFiniteTrainingError
from callbacks.reliability.preemption import received_signal
from lightning_mods.checkpointing import atomic_files
from lightning_mods.checkpointing.rebuild import import_path
from lightning_mods._compat import lightning_private


class ShortcutLabCLI(LightningCLI):
    """LightningCLI with the data -> model links and the default callbacks."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 (jsonargparse parser)
        for name in LINKED_FROM_DATA:  # the network a recipe is given: fill_network_from_data
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
                                 "except the every-epoch resume point (EpochResumePoint); null: as the config says")
        parser.add_argument(
            "--replace_module_optimizer", type=bool, default=False,
            help="Let --optimizer (and --lr_scheduler) replace the model's own configure_optimizers recipe "
                 "(its parameter groups, learning-rate scaling and schedule). Without it --optimizer is an error.")
        parser.add_argument(
            "--reproducible", type=bool, default=False,
            help="The reproducible CPU mode: the same numbers to the last bit on any x86-64 machine and core count "
                 "(commands/reproducible_cpu.py; slower). The shortcutlab command sets it before torch loads.")

    def parse_arguments(self, parser, args) -> None:  # noqa: ANN001 (jsonargparse parser, args)
        """Lightning's parsing; with raising parsers (``console_main``) a parse error becomes one
        :class:`BadInput` line, and ``ckpt_path`` is checked before anything reads it."""
        lightning_private.set_argument_help(self, "ckpt_path", lambda name: CKPT_PATH_HELP[name == "fit"])
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            raise BadInput(config_syntax_error(args) or explain_parse_error(err, self.option_names())) from err
        self.check_optimizer_override()
        subcommand = self.config.get("subcommand")
        if subcommand == "fit":
            resolve_auto_ckpt_path(self.config[subcommand])
        if subcommand:
            resolve_folder_ckpt_path(self.config[subcommand], subcommand)
        # read once here; check_ckpt_path_against_config uses it (checkpoints of large models are gigabytes)
        self._checked_ckpt = check_ckpt_path(self.config[subcommand].get("ckpt_path")) if subcommand else None

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """Lightning's parser, built once the model, data and callback classes are imported
        (jsonargparse lists, and resolves by short name, only the subclasses imported)."""
        catalogue.import_all()
        parser = super().init_parser(**kwargs)
        if not hasattr(self, "built_parsers"):
            self.built_parsers: list[LightningArgumentParser] = []
        self.built_parsers.append(parser)  # the main parser, then one per subcommand
        return parser

    def option_names(self) -> list[str]:
        """The ``--options`` of the subcommands (all alike but for a few ``Trainer`` method
        arguments), for "did you mean"."""
        parsers = [p for p in getattr(self, "built_parsers", []) if p is not getattr(self, "parser", None)]
        return sorted({f"--{key}" for parser in parsers for key in parser.get_defaults(skip_validation=True).keys()})

    def check_optimizer_override(self) -> None:
        """``--optimizer`` replaces a model's own ``configure_optimizers`` only with
        ``--replace_module_optimizer=true`` (then a warning says what no longer applies); an
        ``--lr_scheduler`` without ``--optimizer``, which LightningCLI would ignore, is an error."""
        cfg = self.config.get(str(self.config.get("subcommand")), self.config)
        optimizer, scheduler, model = cfg.get("optimizer"), cfg.get("lr_scheduler"), cfg.get("model")
        class_name = component_name(model) if model is not None else ""
        if optimizer is None and scheduler is not None:
            raise BadInput(f"lr_scheduler: {component_name(scheduler)} is used only together with --optimizer; a "
                           f"model's own schedule is set by its settings (--model.help {class_name or 'NAME'})")
        if optimizer is None or not class_name:
            return
        model_class = import_path(model.class_path)
        if model_class.configure_optimizers is LightningModule.configure_optimizers:
            return  # no recipe of its own to replace
        if not cfg.get("replace_module_optimizer"):
            raise BadInput(
                f"optimizer: {component_name(optimizer)} would replace {class_name}'s own optimiser recipe "
                "(configure_optimizers: parameter groups, learning-rate scaling, schedule); set that recipe through "
                f"the model's settings (--model.help {class_name}), or add --replace_module_optimizer=true to train "
                f"every parameter with {component_name(optimizer)} instead")
        schedule = f"and {describe_component(scheduler)}" if scheduler is not None else "at a constant learning rate"
        rank_zero_warn(
            f"--replace_module_optimizer: {class_name}.configure_optimizers is not used; every parameter trains "
            f"with {describe_component(optimizer)} {schedule}, in one group: the module's own parameter groups "
            "(no weight decay on norms and biases), learning-rate scaling by batch size, warm-up and schedule, "
            "and the model settings they read, do not apply", category=UserWarning)
        # Lightning's own warning says less (that configure_optimizers is overridden): said once, above
        warnings.filterwarnings("ignore", message=r"`\w+\.configure_optimizers` will be overridden by")

    def check_ckpt_path_against_config(self) -> None:
        """The model is the network that wrote ``--ckpt_path``: Lightning's version (the
        checkpoint's hyper-parameters rebuild the model, those its ``__init__`` does not take
        dropped), refusing a checkpoint of another class or with other settings.

        A model class or setting of the config that disagrees with the checkpoint is a one-line
        ValueError naming both values (nothing is built, nothing trains); values linked from the
        data are checked as weight shapes once the model is built (:meth:`instantiate_classes`).

        Replaces a private LightningCLI step on purpose (through
        :func:`lightning_mods._compat.lightning_private.override_parse_ckpt_path`): Lightning runs it
        between ``parse_arguments`` and ``before_instantiate_classes`` and offers no public hook there.
        Its version would replace the config's model by the checkpoint's silently and
        ``torch.load`` the whole checkpoint a second time (gigabytes; ours was read once, memory
        mapped, by ``parse_arguments``). If Lightning renamed or stopped calling it, the
        refusals would be lost: ``tests/lightning_mods/test_checkpoint_identity.py::
        test_ckpt_path_of_another_class_is_a_one_line_error`` fails then.
        """
        self._ckpt_weights: Optional[tuple[str, dict]] = None
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        ckpt = getattr(self, "_checked_ckpt", None) or check_ckpt_path(ckpt_path)
        self._checked_ckpt = None
        self.config, weights = model_of_checkpoint(self.parser, self.config, subcommand, ckpt, ckpt_path)
        self._ckpt_weights = (ckpt_path, weights)

    def before_instantiate_classes(self) -> None:
        cfg = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        reproducible_cpu.check(bool(cfg.get("reproducible")))  # a run that computes, not a parse-only check
        trainer_cfg = cfg.get("trainer", {})
        warn_on_slow_precision(trainer_cfg.get("precision"), trainer_cfg.get("accelerator"))
        apply_cadences(trainer_cfg.get("callbacks") or [], cfg.get("evaluation_every_n_epochs"),
                       cfg.get("checkpoint_every_n_epochs"))
        named = network_by_name(cfg.get("model"))
        self._linked_settings = {**linked_settings_given(cfg.get("model")), **named}
        fill_network_from_data(cfg.get("model"), cfg.get("data"))
        if trainer_cfg.get("enable_progress_bar") is False and trainer_cfg.get("callbacks"):
            # honour enable_progress_bar=false instead of failing on the default Rich bar
            trainer_cfg["callbacks"] = [c for c in trainer_cfg["callbacks"] if not is_progress_bar(c)]

    def after_instantiate_classes(self) -> None:
        if getattr(self, "_ckpt_weights", None) is not None:
            ckpt_path, state = self._ckpt_weights
            self._ckpt_weights = None
            check_weights_fit(self.model, ckpt_path, state)
        for name, given in getattr(self, "_linked_settings", {}).items():
            attribute = DATA_NAMES.get(name.rpartition(".")[2], name.rpartition(".")[2])  # the data's name of it
            from_data = getattr(self.datamodule, attribute, None)
            if from_data is not None and given != from_data:  # the link would replace the setting silently
                raise BadInput(f"model.{name}={given!r} disagrees with the data's {attribute} ({from_data!r}; "
                               f"{type(self.datamodule).__name__}): the model takes it from the data, so drop "
                               f"model.{name} or change the data")
        expect_frozen_eval_modules(self.model)
        answer_repeated_samples_warning(self.model)
        ckpt_path = (self.config.get(str(self.subcommand)) or {}).get("ckpt_path")
        answer_resume_warnings(self.trainer, str(self.subcommand), ckpt_path)
        if self.subcommand == "fit":  # before anything reads the loggers' folders (and so fixes their versions)
            self._kept_metrics = continue_logger_versions(self.trainer, ckpt_path)
        answer_folder_warnings(self.trainer, str(self.subcommand), ckpt_path)
        add_required_callbacks(self.trainer)
        if self.subcommand == "predict":
            add_prediction_writer(self.trainer)
        # the data is there before the trainer runs: in the launching process, which a DDP run would
        # otherwise follow by starting every other process before any of them reads the data
        check = getattr(self.datamodule, "check_files", None)
        if self.subcommand and callable(check) and not getattr(self.datamodule, "download", False):
            check()

    def after_fit(self) -> None:
        merge_kept_metrics(getattr(self, "_kept_metrics", []))


def main(args: Optional[list[str]] = None, parser_kwargs: Optional[dict[str, Any]] = None) -> ShortcutLabCLI:
    """Run the CLI on ``args`` (``sys.argv`` when None) and return it (trainer, model, data)."""
    return ShortcutLabCLI(
        LightningModule, LightningDataModule,
        subclass_mode_model=True, subclass_mode_data=True,
        save_config_callback=RunConfig, save_config_kwargs={"overwrite": True},
        parser_kwargs=parser_kwargs,
        args=args,
    )


class _Parsed(Exception):
    """Raised by :class:`_ParseOnlyCLI` once the arguments are parsed: nothing is built."""

    def __init__(self, cli: "ShortcutLabCLI") -> None:
        super().__init__()
        self.cli = cli


class _ParseOnlyCLI(ShortcutLabCLI):
    def check_ckpt_path_against_config(self) -> None:  # the last check: stop before the seed (an RNG draw)
        super().check_ckpt_path_against_config()
        raise _Parsed(self)


class ArgumentChecker:
    """Parses ``shortcutlab`` training arguments (``["fit", "--config=...", ...]``) as a run would,
    building and training nothing; the parser (every model, datamodule and callback class
    signature) is built once and reused for every argument list checked."""

    def __init__(self) -> None:
        self._cli: Optional[_ParseOnlyCLI] = None
        self._checked: Optional[tuple[str, ...]] = None  # the arguments self._cli.config holds

    def __call__(self, args: list[str]) -> Optional[str]:
        """None when ``args`` parse, else the one-line reason a run would give (an unknown key with
        its "did you mean", a value of the wrong type, a missing file). Values only a class's
        ``__init__`` checks (a range, say) show when the run builds it."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                if self._cli is None:
                    _ParseOnlyCLI(LightningModule, LightningDataModule, subclass_mode_model=True,
                                  subclass_mode_data=True, parser_kwargs=raising_parsers(), args=list(args))
                else:  # LightningCLI.__init__'s steps after the parser is built
                    self._cli.parse_arguments(self._cli.parser, list(args))
                    self._cli.check_ckpt_path_against_config()
            except _Parsed as parsed:
                self._cli, self._checked = parsed.cli, tuple(args)
                return None
            except (ValueError, FileNotFoundError, MisconfigurationException) as err:
                return root_message(err)
            except SystemExit:  # --help or --print_config among the arguments
                return "the arguments print help or a config instead of running"
        return None

    def check_setting(self, args: list[str], key: str, value: str) -> Optional[str]:
        """None when ``args`` followed by ``--key=value`` parse, else why not. ``args`` are parsed in
        full once (then remembered); the setting is parsed onto that config, its value checked
        against its setting's type in milliseconds (not the whole config again); a refused one is
        parsed in full for the run's own message."""
        if self._checked != tuple(args):
            reason = self(args)
            if reason is not None:
                return reason
        subcommand = args[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                lightning_private.parse_setting(self._cli, subcommand, f"--{key}={value}")
                return None
            except (Exception, SystemExit):  # the full parse below gives the run's own words
                pass
        return self([*args, f"--{key}={value}"])

    def parsed(self, key: str) -> Any:
        """``key`` (``trainer.logger``) of the config :meth:`__call__` parsed last."""
        return self._cli.config[self._cli.config["subcommand"]][key]


def check_arguments(args: list[str]) -> Optional[str]:
    """One :class:`ArgumentChecker` call: None when ``args`` parse as a run would, else why not."""
    return ArgumentChecker()(args)


def run_reporting_stops(args: Optional[list[str]] = None, **main_kwargs: Any) -> None:
    """``main``, with the exit statuses of a stopped fit: a divergence (one line, status 3) and a
    pre-emption (``128 + signal``: 143 for SIGTERM, 130 for SIGINT; callbacks/reliability/preemption.py)."""
    try:
        main(args, **main_kwargs)
    except NonFiniteTrainingError as err:
        if os.environ.get("SHORTCUTLAB_TRACEBACK"):
            raise
        print(f"shortcutlab: error: {err}", file=sys.stderr)
        sys.exit(exit_statuses.DIVERGED)
    except RuntimeError as err:  # Lightning's refusal of two callbacks with one state_key: one line
        raise duplicate_callback_message(err) or err
    except SIGTERMException:
        sys.exit(exit_statuses.stopped_by(received_signal() or signal.SIGTERM))


def raising_parsers() -> dict[str, Any]:
    """``parser_kwargs`` under which jsonargparse raises its errors instead of printing usage."""
    return {"exit_on_error": False, **{name: {"exit_on_error": False} for name in ShortcutLabCLI.subcommands()}}


def console_main(args: Optional[list[str]] = None) -> None:
    """The ``shortcutlab`` console command on ``args`` (``sys.argv`` when None; returns None: a
    console script exits with its value).

    A bad setting or a missing file ends with one line on stderr and exit status 2; a file that
    cannot be written (full disk, quota, read-only, permissions) with one line and exit status 4
    (:mod:`lightning_mods.checkpointing.atomic_files`); a lost DDP peer with one line naming it and exit status 5
    (:mod:`callbacks.reliability.lost_rank`); ``SHORTCUTLAB_TRACEBACK=1`` shows the traceback instead.
    """
    info_logs_to_stdout()
    silence_third_party_noise()
    try:
        run_reporting_stops(args, parser_kwargs=raising_parsers())
    except (ValueError, FileNotFoundError, MisconfigurationException) as err:
        if os.environ.get("SHORTCUTLAB_TRACEBACK"):
            raise
        print(f"shortcutlab: error: {root_message(err)}", file=sys.stderr)
        sys.exit(exit_statuses.BAD_INPUT)
    except Exception as err:  # noqa: BLE001 (the two faults below get one line; anything else its traceback)
        if os.environ.get("SHORTCUTLAB_TRACEBACK"):
            raise
        if isinstance(err, OSError) and err.errno in atomic_files.DISK_ERRORS:  # full disk, quota, read-only ...
            message = str(err) if isinstance(err, atomic_files.DiskWriteError) else \
                atomic_files.describe(err, Path(err.filename or "?"), None)
            print(f"shortcutlab: error: {message}", file=sys.stderr)
            sys.exit(exit_statuses.DISK_ERROR)
        if lost_rank.lost_rank_message is not None:  # a DDP peer died (callbacks/reliability/lost_rank.py)
            print(f"shortcutlab: error: {lost_rank.lost_rank_message}", file=sys.stderr)
            sys.exit(exit_statuses.LOST_RANK)
        raise
    finally:
        end_process_group()


def end_process_group() -> None:
    """Destroy the default process group of a DDP run before the interpreter exits: left to the
    interpreter's own teardown, gloo's threads have aborted a finished run now and then ("terminate
    called without an active exception", exit status 134 instead of 0 or the pre-emption's)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # a lost peer: nothing left to end cleanly
            dist.destroy_process_group()


lightning_private.override_parse_ckpt_path(ShortcutLabCLI, lambda cli: cli.check_ckpt_path_against_config())

if __name__ == "__main__":
    console_main()
