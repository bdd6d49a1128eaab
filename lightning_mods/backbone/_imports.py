"""The one importer of dotted class paths (``"torch.nn.ReLU"``, a config's ``class_path``)."""
from __future__ import annotations

import importlib
from typing import Any


def import_path(path: str) -> Any:
    """The object ``module.name`` names: ImportError (no such module), AttributeError (no such
    name in it) or ValueError (no module part)."""
    module_name, _, name = str(path).rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not a dotted path (module.name)")
    return getattr(importlib.import_module(module_name), name)
