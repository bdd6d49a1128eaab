"""The grid of a sweep: its axes (``--grid KEY=V1,V2``), their points, the run names built from
the grid values (``alpha_min=0.6,seed=1``) and back, and the ``--evaluate`` fits each run gets."""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from commands._run_folder import FOLLOW_UP_DIR

# grid keys whose last component is not a readable name
SHORT_NAMES = {"seed_everything": "seed"}


def parse_axis(text: str) -> tuple[str, list[str]]:
    """``"model.shortcut.alpha_min=0.6,0.8"`` -> ``("model.shortcut.alpha_min", ["0.6", "0.8"])``."""
    key, sep, values = text.partition("=")
    key = key.strip().removeprefix("--")
    items = [v.strip() for v in values.split(",")] if sep else []
    if not key or not items or any(not v for v in items):
        raise ValueError(f"--grid: expected KEY=V1,V2,... (e.g. model.shortcut.alpha_min=0.6,1.0), got {text!r}")
    for value in items:  # the values make the run's folder name, which parse_run_name must invert
        if any(c in value for c in "=/\\"):
            raise ValueError(f"--grid {key}: a value may not hold '=', '/' or '\\' (it names the run's folder), "
                             f"got {value!r}")
    return key, items


def short_name(key: str) -> str:
    """The name a grid key has in run names: its last component (``seed`` for ``seed_everything``)."""
    return SHORT_NAMES.get(key, key.rsplit(".", 1)[-1])


def grid_points(axes: Sequence[tuple[str, list[str]]]) -> list[dict[str, str]]:
    """Every combination of the axes' values, the first axis varying slowest."""
    names = [short_name(key) for key, _ in axes]
    if len(set(names)) != len(names):
        raise ValueError(f"--grid: two axes have the same short name ({', '.join(names)}); run names would clash")
    keys = [key for key, _ in axes]
    return [dict(zip(keys, values)) for values in itertools.product(*(values for _, values in axes))]


def run_name(point: dict[str, str]) -> str:
    """``{"model.shortcut.alpha_min": "0.6", "seed_everything": "1"}`` -> ``alpha_min=0.6,seed=1``."""
    return ",".join(f"{short_name(key)}={value}" for key, value in point.items()) or "run"


def parse_run_name(name: str) -> dict[str, str]:
    """The grid values a run's folder name holds (inverse of :func:`run_name`)."""
    if name == "run":
        return {}
    return dict(part.split("=", 1) for part in name.split(",") if "=" in part)


EVALUATION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
RESERVED_FOLDERS = (FOLLOW_UP_DIR, "checkpoints", "pictures", "report")


@dataclass(frozen=True)
class Evaluation:
    """One ``--evaluate NAME=CONFIG[,CONFIG...][,KEY=VALUE...]`` (or the ``--then`` fit, named
    ``probe``): a fit from each run's checkpoint, logged to ``<run>/NAME``."""

    name: str
    configs: tuple[str, ...]
    settings: tuple[str, ...]

    @property
    def option(self) -> str:
        """How the command line named it: ``--then`` (the evaluation ``probe``) or ``--evaluate NAME``."""
        return "--then" if self.name == FOLLOW_UP_DIR else f"--evaluate {self.name}"


def parse_evaluation(text: str) -> Evaluation:
    """``NAME=CONFIG[,CONFIG...][,KEY=VALUE...]``: the configs composed in order, then the settings
    (an item with ``=`` is a setting, e.g. ``data.init_args.data_dir=/data/imagenet``)."""
    name, sep, rest = text.partition("=")
    if not sep or not rest:
        raise ValueError(f"--evaluate: expected NAME=CONFIG[,CONFIG...], got {text!r}")
    if not EVALUATION_NAME.fullmatch(name) or name in RESERVED_FOLDERS:
        raise ValueError(f"--evaluate: {name!r} cannot name an evaluation folder (letters, digits, _ and -, "
                         f"starting with a letter; not {', '.join(RESERVED_FOLDERS)})")
    items = [item for item in rest.split(",") if item]
    configs = tuple(item for item in items if "=" not in item)
    if not configs:
        raise ValueError(f"--evaluate {name}: names no config file")
    for config in configs:
        if not Path(config).is_file():
            raise FileNotFoundError(f"--evaluate {name}: no file '{config}'")
    return Evaluation(name, configs, tuple(item for item in items if "=" in item))


def as_options(settings: Sequence[str]) -> list[str]:
    """``KEY=VALUE`` settings as ``--KEY=VALUE`` options."""
    return [a if a.startswith("--") else f"--{a}" for a in settings]
