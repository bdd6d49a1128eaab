"""The classes a ``shortcutlab`` config can name (models, data, callbacks), found by reading the
source, so ``shortcutlab --help`` lists them without importing torch; and the imports that
make LightningCLI know them (``fit --help`` lists them, ``--model MaskedAutoencoder`` resolves).

A class counts when it subclasses one of the Lightning bases of its kind, directly or through
other classes of the same package; only the leaves are listed (``ImageDataModule`` is a base
of ``Digits``, not something to train on).
"""
from __future__ import annotations

import ast
import functools
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# kind -> (package, the Lightning base classes of that kind, by the name the source uses)
KINDS = {
    "model": ("lightning_mods", ("LightningModule",)),
    "data": ("datamodules", ("LightningDataModule",)),
    "callback": ("callbacks", ("Callback", "BasePredictionWriter", "RichModelSummary", "ModelCheckpoint",
                              "RichProgressBar", "EMAWeightAveraging", "LearningRateMonitor")),
}


@dataclass(frozen=True)
class Found:
    """One class: its name, the module defining it, the first sentence of its docstring and,
    for a callback, when it works (its ``cost`` attribute, :mod:`callbacks.cost`)."""

    name: str
    module: str
    summary: str
    cost: str = ""

    @property
    def class_path(self) -> str:
        return f"{self.module}.{self.name}"


def _first_sentence(docstring: str | None) -> str:
    paragraph = " ".join((docstring or "").split("\n\n")[0].split())
    paragraph = re.sub(r":\w+:`~?([^`]+)`", r"\1", paragraph).replace("``", "")  # reST roles and literals
    return re.sub(r"\s*\(see (the )?module docstring\)", "", paragraph)


def _base_name(node: ast.expr) -> str:
    """``L.LightningDataModule`` -> ``LightningDataModule``."""
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _cost(node: ast.ClassDef) -> str:
    """The name assigned to ``cost`` in the class body (``cost = PER_STEP`` -> ``per step``)."""
    for statement in node.body:
        if isinstance(statement, ast.Assign) and [getattr(t, "id", "") for t in statement.targets] == ["cost"]:
            value = statement.value
            if isinstance(value, ast.Constant):
                return str(value.value)
            return getattr(value, "id", "").lower().replace("_", " ")
    return ""


def public_module_files(package: str) -> list[Path]:
    """The modules of ``package`` and its sub-packages, less the private ones (``_utils/``,
    ``_graveyard.py``) and the packages' ``__init__``."""
    return [p for p in sorted((ROOT / package).rglob("*.py"))
            if not any(part.startswith("_") for part in p.relative_to(ROOT).parts)]


def find(kind: str) -> list[Found]:
    """The classes of ``kind`` (``model``, ``data``, ``callback``) in their package, by name."""
    return list(_read(kind))


@functools.cache  # the source is read once a process: LightningCLI builds a parser per subcommand
def _read(kind: str) -> tuple[Found, ...]:
    package, roots = KINDS[kind]
    bases: dict[str, list[str]] = {}
    found: dict[str, Found] = {}
    costs: dict[str, str] = {}
    for path in public_module_files(package):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [_base_name(b) for b in node.bases]
                costs[node.name] = _cost(node)
                found[node.name] = Found(node.name, module, _first_sentence(ast.get_docstring(node)))

    def is_kind(name: str, seen: frozenset = frozenset()) -> bool:
        return any(b in roots or (b in bases and b not in seen and is_kind(b, seen | {name})) for b in bases[name])

    def cost(name: str) -> str:  # its own, else the first in-package base's
        return costs.get(name) or next((c for b in bases.get(name, []) if b in bases and (c := cost(b))), "")

    used_as_base = {b for names in bases.values() for b in names}
    return tuple(sorted((Found(f.name, f.module, f.summary, cost(name)) for name, f in found.items()
                         if is_kind(name) and name not in used_as_base), key=lambda f: f.name))


def import_all() -> None:
    """Import every module that defines a model, datamodule or callback: jsonargparse lists and
    resolves by short name only the subclasses already imported."""
    for kind in KINDS:
        for module in sorted({f.module for f in find(kind)}):
            importlib.import_module(module)
