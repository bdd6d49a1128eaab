"""Pictures of a run: labelled grids and where they are written (`grids`), the patch-feature
picture (`patch_pca`) and the embedding map of predictions (`embedding_map`).

``lightning_mods.pictures`` was once the module that ``grids`` is now: its names still resolve
here (``from lightning_mods.pictures import log_picture``), with a ``FutureWarning``.
"""
from __future__ import annotations

import importlib
import warnings

__all__ = ["grids", "patch_pca", "embedding_map"]
_GRID_NAMES = ("run_dir", "picture_dir", "figure_to_array", "to_uint8_image", "save_png", "log_picture",
               "image_grid", "labelled_grid", "Picture")


def __getattr__(name: str):
    if name in _GRID_NAMES:
        warnings.warn(f"lightning_mods.pictures.{name} moved to lightning_mods.pictures.grids.{name}; import it "
                      "from there (the old path will go in a later release)", FutureWarning, stacklevel=2)
        return getattr(importlib.import_module("lightning_mods.pictures.grids"), name)
    raise AttributeError(f"module 'lightning_mods.pictures' has no attribute {name!r}")
