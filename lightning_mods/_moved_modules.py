"""Old module paths that still import, with a one-time ``FutureWarning`` naming the new path.

Saved run configs, sweep files and checkpoints name classes by module path
(``callbacks.knn.KNNEvaluator``). When a module moves, its old path is listed here and keeps
loading the same module object, the way timm kept ``timm.models.layers`` importing after its
move to ``timm.layers``.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there (the old path will go "
                      "in a later release)", FutureWarning, stacklevel=3)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the new module has run already; the import system has just set its ``__spec__`` to the
        # old name, so put back the one it was loaded with
        module.__spec__ = self.spec


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds each old module path of ``moves`` (old -> new dotted path) as the new module."""

    def __init__(self, moves: dict[str, str]):
        self.moves = dict(moves)

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        new = self.moves.get(fullname)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new)) if new else None


def install(moves: dict[str, str]) -> None:
    """Make every old path of ``moves`` import as its new module (once per interpreter)."""
    if not any(isinstance(f, MovedModules) and f.moves == moves for f in sys.meta_path):
        sys.meta_path.append(MovedModules(moves))
