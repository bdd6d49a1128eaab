"""shortcutlab command line: a LightningCLI (``fit``, ``validate``, ``test``, ``predict``).

    shortcutlab fit --config configs/digits_mae.yaml
    python cli.py validate --config configs/digits_mae.yaml --ckpt_path runs/.../last.ckpt

Values that data and model must agree on (image size, channels, number of classes) are
linked from the datamodule to the model; a model that has no such argument ignores the link.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.cli import LightningCLI, _InstantiatorFn

from callbacks.prediction_writer import PredictionWriter

DEFAULT_CALLBACKS = [
    {"class_path": "lightning.pytorch.callbacks.RichProgressBar"},
    {"class_path": "lightning.pytorch.callbacks.RichModelSummary", "init_args": {"max_depth": 2}},
]


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


def _init_parameters(class_path: str) -> Optional[set[str]]:
    """Names of the ``__init__`` parameters of ``class_path``; ``None`` if it takes ``**kwargs``."""
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return None
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params} - {"self"}


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
        for name in ("image_size", "in_chans", "num_classes"):
            parser.link_arguments(
                "data", f"model.init_args.{name}", compute_fn=lambda data, name=name: getattr(data, name, None),
                apply_on="instantiate",
            )
        # set_defaults (not trainer_defaults) keeps these replaceable from YAML
        parser.set_defaults({"trainer.callbacks": DEFAULT_CALLBACKS})

    def _add_instantiators(self) -> None:
        super()._add_instantiators()
        self.parser.add_instantiator(_TopLevelModelHyperparameters(self), LightningModule, subclasses=True,
                                     prepend=True)

    def _parse_ckpt_path(self) -> None:
        """Lightning's version, minus hyper-parameters the model's ``__init__`` does not take.

        A CLI-built module records every linked value in its hyper-parameters, also one its
        class has no argument for (``num_classes`` on an MAE); fed back as keyword arguments
        those would break ``validate --ckpt_path``.
        """
        if not self.config.get("subcommand"):
            return
        ckpt_path = self.config[self.config.subcommand].get("ckpt_path")
        if not ckpt_path or not Path(ckpt_path).is_file():
            return
        ckpt = torch.load(ckpt_path, weights_only=True, map_location="cpu")
        hparams = dict(ckpt.get("hyper_parameters", {}))
        hparams.pop("_instantiator", None)
        if "_class_path" not in hparams:
            return super()._parse_ckpt_path()
        class_path = hparams.pop("_class_path")
        accepted = _init_parameters(class_path)
        if accepted is not None:
            hparams = {k: v for k, v in hparams.items() if k in accepted}
        model = {"class_path": class_path, "dict_kwargs": hparams}
        try:
            self.config = self.parser.parse_object({self.config.subcommand: {"model": model}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def before_instantiate_classes(self) -> None:
        cfg = self.config.get(str(self.subcommand), self.config) if self.subcommand else self.config
        trainer_cfg = cfg.get("trainer", {})
        warn_on_slow_precision(trainer_cfg.get("precision"), trainer_cfg.get("accelerator"))
        if trainer_cfg.get("enable_progress_bar") is False and trainer_cfg.get("callbacks"):
            # honour enable_progress_bar=false instead of failing on the default Rich bar
            trainer_cfg["callbacks"] = [c for c in trainer_cfg["callbacks"]
                                        if not str(_class_path(c)).endswith("ProgressBar")]

    def after_instantiate_classes(self) -> None:
        if self.subcommand == "predict":
            add_prediction_writer(self.trainer)


def add_prediction_writer(trainer) -> None:  # noqa: ANN001 (Trainer)
    """``predict`` saves its outputs (``callbacks/prediction_writer.py``) unless a writer is configured."""
    if not any(isinstance(callback, BasePredictionWriter) for callback in trainer.callbacks):
        trainer.callbacks.append(PredictionWriter())


def main(args: Optional[list[str]] = None) -> ShortcutLabCLI:
    """Run the CLI on ``args`` (``sys.argv`` when None) and return it (trainer, model, data)."""
    return ShortcutLabCLI(
        LightningModule, LightningDataModule,
        subclass_mode_model=True, subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def root_message(err: BaseException) -> str:
    """First line of the innermost cause: jsonargparse wraps a class's own one-line
    ``ValueError`` ("alpha_min must be ...") in multi-line reports of every Union member tried."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def console_main() -> None:
    """The ``shortcutlab`` console command (returns None: a console script exits with its value).

    A bad setting or a missing file ends with one line on stderr and exit status 2;
    ``SHORTCUTLAB_TRACEBACK=1`` shows the traceback instead.
    """
    try:
        main()
    except (ValueError, FileNotFoundError) as err:
        if os.environ.get("SHORTCUTLAB_TRACEBACK"):
            raise
        print(f"shortcutlab: error: {root_message(err)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    console_main()
