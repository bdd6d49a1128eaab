"""Old module paths that saved configs name, importing until the release that removes them.

A run's saved ``config.yaml`` (and a sweep's ``run.yaml``) names its callbacks by module path;
release 0.1.0 wrote ``callbacks.knn.KNNEvaluator`` before the callbacks moved into their role
folders. Each old path below still imports the moved module itself, with one ``FutureWarning``
that names the new path and the release that removes the old one. Only paths a config names are
kept (checkpoints name their model and datamodule classes, which did not move); a helper module
that moved has no shim.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# old module path -> (new module path, the release without the old path)
SHIMS = {
    "callbacks.knn": ("callbacks.measurement.knn", "0.3.0"),
    "callbacks.online_probe": ("callbacks.measurement.online_probe", "0.3.0"),
    "callbacks.effective_rank": ("callbacks.measurement.effective_rank", "0.3.0"),
    "callbacks.fid": ("callbacks.measurement.fid", "0.3.0"),
    "callbacks.patch_features": ("callbacks.measurement.patch_features", "0.3.0"),
    "callbacks.residual_droppath": ("callbacks.training.residual_droppath", "0.3.0"),
    "callbacks.ema": ("callbacks.training.ema", "0.3.0"),
    "callbacks.compile": ("callbacks.training.compile", "0.3.0"),
    "callbacks.exact_resume": ("callbacks.reliability.exact_resume", "0.3.0"),
    "callbacks.nonfinite_guard": ("callbacks.reliability.nonfinite_guard", "0.3.0"),
    "callbacks.preemption": ("callbacks.reliability.preemption", "0.3.0"),
    "callbacks.fresh_monitor_checkpoint": ("callbacks.reliability.fresh_monitor_checkpoint", "0.3.0"),
    "callbacks.fit_end_record": ("callbacks.reliability.fit_end_record", "0.3.0"),
    "callbacks.progress_bar": ("callbacks.reporting.progress_bar", "0.3.0"),
    "callbacks.model_summary": ("callbacks.reporting.model_summary", "0.3.0"),
    "callbacks.run_summary": ("callbacks.reporting.run_summary", "0.3.0"),
    "callbacks.prediction_writer": ("callbacks.reporting.prediction_writer", "0.3.0"),
}


class _Shim(importlib.abc.Loader):
    def __init__(self, new: str, removed_in: str):
        self.new, self.removed_in = new, removed_in

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; the old path is removed in shortcutlab {self.removed_in} "
                      "(write the new one in your config)", FutureWarning, stacklevel=3)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the new module has run already; the import system has just set its ``__spec__`` to the
        # old name, so put back the one it was loaded with
        module.__spec__ = self.spec


class OldPaths(importlib.abc.MetaPathFinder):
    """Finds each old path of :data:`SHIMS` as its new module."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:  # noqa: ANN001
        shim = SHIMS.get(fullname)
        return importlib.machinery.ModuleSpec(fullname, _Shim(*shim)) if shim else None


def install() -> None:
    """Make the old paths import (once per interpreter)."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.append(OldPaths())
