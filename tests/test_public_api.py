"""What each package says is public (``__all__``) exists and imports, and the class paths
configs and checkpoints name stay where they are."""
from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("package", ["lightning_mods", "lightning_mods.backbone", "callbacks", "datamodules"])
def test_every_public_name_imports(package):
    module = importlib.import_module(package)
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert getattr(module, name, None) is not None or importlib.import_module(f"{package}.{name}"), name


def test_module_classes_keep_their_class_paths():
    """jsonargparse writes the shortest import path of a class: a class re-exported by
    ``lightning_mods`` would change every class path written into configs and checkpoints."""
    from jsonargparse._util import get_import_path

    from callbacks.measurement.knn import KNNEvaluator
    from lightning_mods.mae import MaskedAutoencoder

    assert get_import_path(MaskedAutoencoder) == "lightning_mods.mae.MaskedAutoencoder"
    assert get_import_path(KNNEvaluator) == "callbacks.measurement.knn.KNNEvaluator"
