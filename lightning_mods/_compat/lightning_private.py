"""Every private Lightning (and torchmetrics) attribute the package touches, in one module.

Exact resume and pre-emption need a few things Lightning keeps private: the running sums of
the epoch's logged training metrics (to carry them across a mid-epoch checkpoint), the stop flag
its signal handlers raise, and a LightningCLI step with no public hook. Each is reached only
through a function here, so a Lightning release that moves one breaks this module's tests
(``tests/lightning_mods/test_lightning_private.py``) and not a resumed run in silence.

Each function names the private attribute it reaches and the Lightning releases its tests passed
on (``@reaches``; the package's one table of private uses,
:data:`lightning_mods._compat.private_uses.PRIVATE_USES`); ``TESTED_LIGHTNING`` is the releases every
one of them passed on, and :func:`untested_lightning_warning` the one line ``ExactResume`` prints at
the start of a fit on any other.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import lightning
from lightning.pytorch.core.mixins import hparams_mixin
from torchmetrics import Metric

from lightning_mods._compat import private_uses

# the releases tests/callbacks/test_resume.py, test_preemption.py and test_checkpoint_identity.py pass on
TESTED_LIGHTNING = ("2.6.6",)


def reaches(private: str, tested_on: tuple[str, ...] = TESTED_LIGHTNING) -> Callable:
    """Record that the decorated function reaches Lightning's ``private`` (tested on ``tested_on``)."""
    return private_uses.reaches("lightning", private, tested_on)


def untested_lightning_warning(version: str = lightning.__version__) -> Optional[str]:
    """One line when ``version`` is not among :data:`TESTED_LIGHTNING`, else None."""
    if version.split("+")[0] in TESTED_LIGHTNING:
        return None
    return (f"Lightning {version} is not among the releases exact resume is tested on "
            f"({', '.join(TESTED_LIGHTNING)}): a resumed run may differ from the uninterrupted one; "
            "run tests/callbacks/test_resume.py on it before trusting resumed results")


# --- the epoch's logged training metrics (exact resume) ---------------------------------------
@reaches("Trainer.fit_loop.epoch_loop._results")
def epoch_results(trainer: Any) -> Any:
    """The training epoch's result collection: ``key -> result`` with ``.value``, ``.meta``,
    ``.cumulated_batch_size``, ``.is_tensor`` and ``.has_reset`` (Lightning's
    ``_ResultCollection``)."""
    return trainer.fit_loop.epoch_loop._results


@reaches("LightningModule._current_fx_name")
def current_hook_name(pl_module: Any) -> str:
    """The hook Lightning is running (the prefix of the result keys ``self.log`` writes)."""
    return pl_module._current_fx_name


@reaches("torchmetrics Metric._defaults")
def metric_state_names(metric: Metric) -> list[str]:
    """The names of a torchmetrics ``Metric``'s states."""
    return list(metric._defaults)


@reaches("torchmetrics Metric._reduce_states, Metric._computed")
def add_metric_states(metric: Metric, states: dict[str, Any]) -> None:
    """Fold ``states`` into the metric's own (current + given, its reduction) and drop its
    cached value."""
    metric._reduce_states(states)
    metric._computed = None


# --- the stop flag and signal handling (pre-emption) ------------------------------------------
@reaches("Trainer._signal_connector.received_sigterm")
def raise_stop_flag(trainer: Any) -> None:
    """Lightning's flag that ends the fit at the next batch boundary (``trainer.received_sigterm``)."""
    trainer._signal_connector.received_sigterm = True


@reaches("Trainer._signal_connector._original_handlers")
def original_signal_handlers(trainer: Any) -> dict:
    """The handlers Lightning put back at teardown (a dict it owns; empty when it has none)."""
    originals = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
    return originals if isinstance(originals, dict) else {}


@reaches("Trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor")
def without_sigterm_broadcast(trainer: Any) -> None:
    """Stop Lightning's per-step broadcast of the stop flag across ranks (a collective every
    step); the caller decides the stop across ranks itself."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


@reaches("Trainer._accelerator_connector.cluster_environment")
def connector_cluster_environment(trainer: Any) -> Any:
    """The cluster environment Lightning's signal handlers read, also for a single-device
    strategy (which has none of its own)."""
    return getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)


# --- LightningCLI and hyper-parameters (checkpoints rebuild their network) --------------------
CLI_PARSE_CKPT_PATH = "_parse_ckpt_path"


@reaches("LightningCLI._parse_ckpt_path")
def override_parse_ckpt_path(cli_class: type, method: Callable[[Any], None]) -> None:
    """Make ``method`` the step LightningCLI runs between ``parse_arguments`` and
    ``before_instantiate_classes`` (its private ``_parse_ckpt_path``; there is no public hook).
    Fails at import, in one line, if Lightning no longer has that step."""
    if not callable(getattr(cli_class, CLI_PARSE_CKPT_PATH, None)):
        raise RuntimeError(f"LightningCLI {lightning.__version__} has no {CLI_PARSE_CKPT_PATH}: shortcutlab's check "
                           "of --ckpt_path against the config cannot run; use a Lightning release in "
                           f"{', '.join(TESTED_LIGHTNING)}")
    setattr(cli_class, CLI_PARSE_CKPT_PATH, method)


@reaches("LightningCLI._subcommand_parsers, jsonargparse ArgumentParser._actions")
def set_argument_help(cli: Any, dest: str, help_of: Callable[[str], str]) -> None:
    """Give the option ``dest`` of every LightningCLI subcommand the help text ``help_of(subcommand)``
    (its private ``_subcommand_parsers``; jsonargparse actions' ``help``)."""
    for name, parser in getattr(cli, "_subcommand_parsers", {}).items():
        for action in parser._actions:
            if action.dest == dest:
                action.help = help_of(name)


@reaches("LightningCLI._subcommand_parsers, and jsonargparse's ArgumentParser.parse_args(_skip_validation) "
         "(jsonargparse 4.53.0)")
def parse_setting(cli: Any, subcommand: str, setting: str) -> None:
    """Parse one ``--key=value`` onto the config ``cli`` parsed, through its ``subcommand``'s parser
    (LightningCLI's private ``_subcommand_parsers``): the value is checked against its setting's
    type (an unknown key or a wrong value raises) without validating the whole config again
    (jsonargparse's private ``_skip_validation``), in milliseconds instead of a full parse's tenths
    of a second."""
    cli._subcommand_parsers[subcommand].parse_args([setting], namespace=cli.config[subcommand].clone(),
                                                   defaults=False, _skip_validation=True)


@reaches("lightning.pytorch.core.mixins.hparams_mixin._given_hyperparameters_context")
@contextlib.contextmanager
def given_hyperparameters(hparams: dict[str, Any], instantiator: str) -> Iterator[None]:
    """Build a LightningModule inside this block and it records ``hparams`` (class path
    included) as LightningCLI's instantiation does."""
    with hparams_mixin._given_hyperparameters_context(hparams, instantiator=instantiator):
        yield


# --- TensorBoard's hyper-parameter view -------------------------------------------------------
@reaches("TensorBoardLogger._default_hp_metric")
def without_hp_metric_placeholder(logger: Any) -> None:
    """A TensorBoardLogger that writes no ``hp_metric`` of -1 when the fit starts (its
    ``default_hp_metric``, a constructor setting, read when the run's hyper-parameters are logged
    after the setup hooks)."""
    logger._default_hp_metric = False


# --- a resumed fit's log folder -----------------------------------------------------------------
@reaches("TensorBoardLogger._version, CSVLogger._version")
def logger_version_given(logger: Any) -> bool:
    """Whether a TensorBoard or CSV logger was given its version (else it takes the next free one
    the first time its folder is needed)."""
    return getattr(logger, "_version", None) is not None


@reaches("TensorBoardLogger._version, CSVLogger._version")
def set_logger_version(logger: Any, version: int) -> None:
    """Make a TensorBoard or CSV logger log into ``version_<version>`` (before its folder is first used)."""
    logger._version = version
