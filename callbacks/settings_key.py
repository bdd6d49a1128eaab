"""Callbacks that may share a Trainer with another instance of their class: a ``state_key`` built
from the settings (as Lightning's ``ModelCheckpoint``) and metric names that stay unique.

A subclass says which settings define what it measures (:meth:`SettingsKeyed.identity`).

- Checkpoints: its state is saved under ``ClassName{settings}``, so two instances (kNN at two
  ``k``, probes at two rates) save and restore their own state. A checkpoint written before the
  key held the settings (keyed by the bare class name) restores into the one instance of that
  class, as before.
- Metric names: one instance logs the plain names (``knn/top1``). With several instances of a
  class in the Trainer, each logs ``<name>@<tag>`` where the tag is its ``name`` argument when
  given, else the settings that differ from the class's defaults (``knn/top1@k=5``); the one
  at the defaults keeps the plain names, so adding a second kNN to a config leaves the first's
  names (and every report and dashboard reading them) as they were. Two instances that would
  log the same names are a one-line error before anything trains.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_mods.checkpointing import migration
from lightning_mods.evaluation import metric_names


def format_setting(value: Any) -> str:
    """A setting as it reads in a metric name: ``0.01``, ``10``, ``features``, ``10-20`` for a list."""
    if isinstance(value, (list, tuple)):
        return "-".join(format_setting(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def check_name(owner: str, name: Optional[str]) -> Optional[str]:
    """``name`` (the tag of an instance's metric names) as given, or a one-line ValueError."""
    if name is not None and (not isinstance(name, str) or not name or any(c in name for c in "@/")):
        raise ValueError(f"{owner}: name must be a non-empty string without '@' or '/', got {name!r}")
    return name


class SettingsKeyed(Callback):
    """Mixin: ``state_key`` from :meth:`identity`, and the instance's metric-name tag.

    Subclasses call ``super().setup`` (which sets :attr:`instance_tag`) and log through
    :meth:`metric`; ``name`` (an optional init argument they store as ``self.name``) overrides
    the automatic tag.
    """

    name: Optional[str] = None
    instance_tag: str = ""  # "" while this is the only instance of its class in the Trainer
    # settings that add measurements (rows over depth) without changing the logged ones: not in tags
    untagged_settings: tuple[str, ...] = ("blocks",)

    def identity(self) -> dict[str, Any]:
        """The settings that define what this instance measures and when (override)."""
        raise NotImplementedError

    @property
    def state_key(self) -> str:
        settings = self.identity()
        if self.name:
            settings = {"name": self.name, **settings}
        return self._generate_state_key(**settings)

    def automatic_tag(self, exclude: tuple[str, ...] = ()) -> str:
        """The settings of :meth:`identity` that differ from the ``__init__`` defaults, ``k=v,...``."""
        defaults = self.default_identity()
        parts = [f"{key}={format_setting(value)}" for key, value in self.identity().items()
                 if key not in exclude and key not in self.untagged_settings
                 and (key not in defaults or _differs(value, defaults[key]))]
        return ",".join(parts)

    def default_identity(self) -> dict[str, Any]:
        """:meth:`identity`'s settings at their defaults (override where they are not ``__init__``'s
        own arguments); a setting missing here always counts as differing."""
        return {name: p.default for name, p in inspect.signature(type(self).__init__).parameters.items()}

    def tag_exclusions(self) -> tuple[str, ...]:
        """Settings the metric names carry per value anyway (``k`` of a k list): not in the tag."""
        return ()

    def value_tags(self) -> list[str]:
        """The per-value parts of the names (``["k=10", "k=20"]`` for a k list; ``[""]``: one value)."""
        return [""]

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        siblings = [cb for cb in trainer.callbacks if type(cb) is type(self)]
        if len(siblings) < 2:
            self.instance_tag = self.name or ""
            return
        tags = {id(cb): cb.name or cb.automatic_tag(cb.tag_exclusions()) for cb in siblings}
        mine = tags[id(self)]
        names = {metric_names.join_tags(mine, value) for value in self.value_tags()}
        for other in siblings:
            if other is not self and names & {metric_names.join_tags(tags[id(other)], v) for v in other.value_tags()}:
                raise ValueError(f"{type(self).__name__}: two instances would log the same names ('{mine or 'plain'}'); give "
                                 "each different settings or a distinct 'name'")
        self.instance_tag = mine

    def metric(self, name: str, *setting_tags: str) -> str:
        """The logged name of vocabulary ``name`` for this instance (and a per-value setting tag)."""
        return metric_names.variant(name, metric_names.join_tags(self.instance_tag, *setting_tags))

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """A state of an earlier release keyed by the bare class name is this instance's when it is
        the one instance of its class (:func:`lightning_mods.checkpointing.migration.rekey_callback_state`)."""
        migration.rekey_callback_state(checkpoint, self, trainer.callbacks)


def _differs(value: Any, default: Any) -> bool:
    if default is inspect.Parameter.empty:
        return True
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return list(value) != list(default)
    return value != default
