"""The settings the ``shortcutlab`` CLI gives every run or checks in a config: the callbacks every
run carries (configs add theirs with ``trainer.callbacks+``), the model settings linked from the
datamodule, the top-level cadence knobs, the ``--ckpt_path`` help, and the prediction writer of
``predict``."""
from __future__ import annotations

import inspect
from typing import Any, Optional

from jsonargparse import Namespace
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from callbacks.reliability.bad_input_cleanup import RemoveLogsOnBadInput
from callbacks.reliability.resume_point import EpochResumePoint
from callbacks.reliability.lost_rank import LostRankReport
from callbacks.reporting.prediction_writer import PredictionWriter
from callbacks.schedule import ScheduledEvaluation
from lightning_mods.checkpointing.rebuild import canonical_class_path, constructor_parameters, import_path

LINKED_FROM_DATA = ("image_size", "in_chans", "num_classes")
# a network's name of a setting the data gives -> the data's (timm's img_size is the data's image_size)
DATA_NAMES = {"img_size": "image_size"}
# Every run carries these (--print_config shows them): a config or the command line adds to them
# with `trainer.callbacks+`; a config's `trainer.callbacks:` replaces them, and then the CLI adds
# back the two that make failures readable (REQUIRED), saying so
DEFAULT_CALLBACKS = [
    {"class_path": "callbacks.reporting.progress_bar.TrainingLossProgressBar"},
    {"class_path": "callbacks.reporting.model_summary.RichModelSummaryWithoutFlops", "init_args": {"max_depth": 2}},
    {"class_path": "callbacks.reliability.exact_resume.ExactResume"},
    {"class_path": "callbacks.reliability.nonfinite_guard.NonFiniteGuard"},
    {"class_path": "callbacks.reliability.preemption.PreemptionCheckpoint"},
    {"class_path": "callbacks.reliability.bad_input_cleanup.RemoveLogsOnBadInput"},
    {"class_path": "callbacks.reliability.lost_rank.LostRankReport"},
    {"class_path": "callbacks.measurement.shared_features.SharedEvaluation"},
    {"class_path": "callbacks.reporting.learning_rate.LearningRates"},
]
REQUIRED = (RemoveLogsOnBadInput, LostRankReport)


def add_required_callbacks(trainer) -> None:  # noqa: ANN001 (Trainer)
    """Add the :data:`REQUIRED` callbacks a replaced list left out (one line says which), and let
    :class:`RemoveLogsOnBadInput` record the log folders that do not exist yet."""
    missing = [cls for cls in REQUIRED if not any(isinstance(c, cls) for c in trainer.callbacks)]
    if missing:
        rank_zero_info(f"trainer.callbacks: added {', '.join(cls.__name__ for cls in missing)} (the CLI's reports "
                       "of bad input and of a lost rank; the config's list replaced the defaults)")
        trainer.callbacks.extend(cls() for cls in missing)
    for callback in trainer.callbacks:
        if isinstance(callback, RemoveLogsOnBadInput):
            callback.watch(trainer)


def _class_path(callback) -> str:  # noqa: ANN001 (Namespace, dict or instance)
    if isinstance(callback, dict) or hasattr(callback, "get"):
        return callback.get("class_path", "")
    return type(callback).__name__


def is_progress_bar(callback: Any) -> bool:
    """Whether a configured callback (its ``class_path``) or an instance is a Lightning progress bar."""
    from lightning.pytorch.callbacks.progress import ProgressBar

    if isinstance(callback, ProgressBar):
        return True
    try:
        cls = import_path(canonical_class_path(str(_class_path(callback))))
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, ProgressBar)


CKPT_PATH_HELP = {
    True: "A checkpoint file to resume from, checked against the config before anything runs, or 'auto': the "
          "newest checkpoint under trainer.default_root_dir that loads (a fresh start when there is none; a "
          "restarted SLURM job does this without asking). Lightning's 'last', 'best', 'hpc', 'registry' and "
          "URLs are refused.",
    False: "A checkpoint file whose weights are used, checked against the config before anything runs "
           "(Lightning's 'last', 'best', 'hpc', 'registry' and URLs are refused).",
}


def linked_settings_given(model) -> dict[str, Any]:  # noqa: ANN001 (parsed class_path/init_args)
    """The settings of ``model`` (or of the ``network`` it is given) that the data links
    (:data:`LINKED_FROM_DATA`) and that the config or the command line set to other than the
    class's default: what a link would replace (a network's timm-style ``img_size`` is the data's
    ``image_size``)."""
    if model is None or not hasattr(model, "get") or not model.get("class_path"):
        return {}
    try:
        defaults, _ = constructor_parameters(import_path(str(model.get("class_path"))))
    except (ImportError, AttributeError, TypeError, ValueError):
        return {}
    init = model.get("init_args") or {}
    given = {}
    for key in (*LINKED_FROM_DATA, *DATA_NAMES):
        value = init.get(key) if hasattr(init, "get") else None
        if key in defaults and value is not None and value != defaults[key].default:
            given[key] = value
    network = init.get("network") if hasattr(init, "get") else None
    return {**{f"network.{k}": v for k, v in linked_settings_given(network).items()}, **given}


def network_by_name(model) -> dict[str, Any]:  # noqa: ANN001 (parsed class_path/init_args)
    """A recipe's ``network`` given as a name of timm's registry, written out in place as the
    ``class_path``/``init_args`` of the network that name builds (built on the meta device: no
    weights), so the data links reach it as any configured network. Returns the name's input
    geometry, which the data must then give (the link would otherwise build another network)."""
    init = model.get("init_args") if model is not None and hasattr(model, "get") else None
    name = init.get("network") if init is not None and hasattr(init, "get") else None
    if not isinstance(name, str):
        return {}
    import timm

    from lightning_mods.checkpointing.network_settings import network_settings  # (its imports register the timm names)

    if not timm.is_model(name):
        raise ValueError(f"model.network: {name!r} is neither a class nor a name in timm's registry "
                         f"(e.g. {', '.join(timm.list_models('mae_*_decayed'))})")
    config = network_settings(timm.create_model(name, device="meta"))
    init["network"] = Namespace(class_path=config["class_path"], init_args=Namespace(**config["init_args"]))
    return {f"network.{key}": config["init_args"][key] for key in (*LINKED_FROM_DATA, *DATA_NAMES)
            if key in config["init_args"]}


def fill_network_from_data(model, data) -> None:  # noqa: ANN001 (parsed class_path/init_args)
    """The data's image size and channels (and, for a class-conditional recipe, its number of
    classes) set in the network a recipe is given (``model.init_args.network``), where the network
    takes them (a timm-style ``img_size`` is the data's ``image_size``): what the links do for a
    model's own settings. A value comes from the data's settings, its class, or, where only a built
    datamodule knows it (latents), a datamodule built from those settings."""
    init = model.get("init_args") if model is not None and hasattr(model, "get") else None
    network = init.get("network") if init is not None and hasattr(init, "get") else None
    if network is None or not hasattr(network, "get") or not network.get("class_path") or data is None:
        return
    try:
        accepted, _ = constructor_parameters(import_path(str(network.get("class_path"))))
        data_class = import_path(str(data.get("class_path")))
    except (ImportError, AttributeError, TypeError, ValueError):
        return
    wanted = {"image_size": "img_size", "in_chans": "in_chans"}  # every network spells it as timm does
    if init.get("class_conditional"):
        wanted["num_classes"] = "num_classes"
    values = data_geometry(data_class, data.get("init_args"), list(wanted))
    if network.get("init_args") is None:
        network["init_args"] = Namespace()
    for key, target in wanted.items():
        if target in accepted and values.get(key) is not None:
            network["init_args"][target] = values[key]


def data_geometry(data_class: type, settings, keys: list[str]) -> dict[str, int]:  # noqa: ANN001 (Namespace)
    """``keys`` of a datamodule of ``data_class`` with ``settings``: its settings, else its class's
    attributes, else those of one built from the settings (None where none says)."""
    settings = settings.as_dict() if hasattr(settings, "as_dict") else dict(settings or {})
    def plain(value: Any) -> Optional[int]:
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    found = {key: plain(settings.get(key)) or plain(getattr(data_class, key, None)) for key in keys}
    if any(value is None for value in found.values()):
        try:
            built = data_class(**settings)
        except Exception:  # noqa: BLE001 (the real instantiation says what is wrong, in one line)
            return found
        found = {key: value if value is not None else plain(getattr(built, key, None)) for key, value in found.items()}
    return found


def component_name(component) -> str:  # noqa: ANN001 (jsonargparse Namespace of a class_path/init_args)
    return str(component.get("class_path", "")).rpartition(".")[2]


def describe_component(component) -> str:  # noqa: ANN001 (jsonargparse Namespace of a class_path/init_args)
    """``AdamW(lr=0.001, weight_decay=0.05)``: the class, its ``lr`` and the settings that differ
    from the class's defaults."""
    class_name = str(component.class_path).rpartition(".")[2]
    defaults = inspect.signature(import_path(str(component.class_path))).parameters
    init = component.get("init_args")
    settings = init.as_dict() if hasattr(init, "as_dict") else dict(init or {})
    shown = {k: v for k, v in settings.items()
             if k == "lr" or k not in defaults or v != defaults[k].default}
    return f"{class_name}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


def apply_cadences(callbacks: list, evaluation_every: Optional[int], checkpoint_every: Optional[int]) -> None:
    """The top-level cadence knobs: ``evaluation_every`` into the evaluation callbacks
    (:class:`callbacks.schedule.ScheduledEvaluation`), ``checkpoint_every`` into the ModelCheckpoint
    callbacks but the resume point (:class:`~callbacks.reliability.resume_point.EpochResumePoint`; parsed
    ``class_path``/``init_args`` entries,
    changed in place; None leaves a cadence as configured)."""
    for callback in callbacks:
        if not hasattr(callback, "get") or callback.get("init_args") is None:
            continue
        try:
            cls = import_path(str(callback.get("class_path", "")))
        except (AttributeError, ValueError):
            cls = None
        init = callback["init_args"]
        if not isinstance(cls, type):
            continue
        if evaluation_every is not None and issubclass(cls, ScheduledEvaluation):
            init["every_n_epochs"] = int(evaluation_every)  # a plain int: PositiveInt does not dump to YAML
        if checkpoint_every is not None and issubclass(cls, ModelCheckpoint) and not issubclass(cls, EpochResumePoint):
            init["every_n_epochs"] = int(checkpoint_every)


def add_prediction_writer(trainer) -> None:  # noqa: ANN001 (Trainer)
    """``predict`` saves its outputs (``callbacks/reporting/prediction_writer.py``) unless a writer is configured."""
    if not any(isinstance(callback, BasePredictionWriter) for callback in trainer.callbacks):
        rank_zero_info("trainer.callbacks: added PredictionWriter (predict saves its outputs; a configured "
                       "prediction writer replaces it)")
        trainer.callbacks.append(PredictionWriter())
