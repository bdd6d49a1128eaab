"""A run written before the helpers moved into their role folders still loads and resumes: its
saved config names ``callbacks.knn.KNNEvaluator`` and its checkpoint was written by those paths.
Every old module path a config names imports the new module itself, with one ``FutureWarning``
naming it and the release that removes the old path; a moved helper that no config names has no
shim.

``tests/data/written_by_0_1_0`` holds the ``config.yaml`` and ``last.ckpt`` of a 2-epoch run of
the quickstart config (a 2-block encoder of width 24, 2 batches an epoch) written by release 0.1.0
before the move."""
from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from callbacks._graveyard import SHIMS
from commands import lightning_cli as cli
from lightning_mods.checkpointing.migration import upgrade_config
from lightning_mods.mae import MaskedAutoencoder

ROOT = Path(__file__).resolve().parents[2]
OLD_RUN = ROOT / "tests" / "data" / "written_by_0_1_0"
MOVED = {old: new for old, (new, _) in SHIMS.items()}


def test_the_saved_config_names_old_module_paths():
    """The fixture is what it claims to be: class paths that no longer exist as files."""
    config = yaml.safe_load((OLD_RUN / "config.yaml").read_text())
    paths = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert "callbacks.knn.KNNEvaluator" in paths and "callbacks.online_probe.OnlineLinearProbe" in paths
    assert not (ROOT / "callbacks" / "knn.py").exists()


def test_every_old_path_imports_the_new_module_with_a_warning():
    """In a fresh interpreter (this one has imported the new paths already)."""
    code = f"""
import importlib, warnings
moved = {MOVED!r}
for old, new in moved.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
        importlib.import_module(old)
    assert module is importlib.import_module(new), (old, module)
    assert module.__spec__.name == new, module.__spec__.name
    said = [str(w.message) for w in caught if issubclass(w.category, FutureWarning) and old in str(w.message)]
    assert len(said) == 1 and new in said[0] and "removed in shortcutlab 0.3.0" in said[0], (old, said)
for gone in ("lightning_mods.optim", "callbacks.distributed", "callbacks.feature_replay"):  # helpers: no shim
    try:
        importlib.import_module(gone)
    except ModuleNotFoundError:
        continue
    raise AssertionError(gone + " still imports")
"""
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_shims_are_the_config_named_paths_and_go_at_their_release():
    """Each shim is an old callback module path (a config names callbacks), and the package's
    version is before the release that removes it: at that release this fails until it is gone."""
    import configparser

    version = configparser.ConfigParser()
    version.read(ROOT / "setup.cfg")
    from packaging.version import Version

    current = Version(version["metadata"]["version"])
    for old, (new, removed_in) in SHIMS.items():
        assert old.startswith("callbacks.") and new.startswith("callbacks."), old
        assert current < Version(removed_in), (old, removed_in)


def test_the_moved_map_names_real_modules_only():
    for old, new in MOVED.items():
        origin = importlib.util.find_spec(new).origin
        assert origin.endswith((new.replace(".", "/") + ".py", new.replace(".", "/") + "/__init__.py")), new
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), f"{old} is both a file and a moved path"


@pytest.mark.slow
def test_a_run_written_before_the_move_resumes(tmp_path):
    config = yaml.safe_load((OLD_RUN / "config.yaml").read_text())
    config = upgrade_config(config)  # the MAE's network settings under model.network, the probe's in its parts
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = cli.main(["fit", f"--config={tmp_path / 'config.yaml'}", f"--ckpt_path={OLD_RUN / 'last.ckpt'}",
                        "--trainer.max_epochs=3", f"--trainer.default_root_dir={tmp_path}",
                        "--trainer.enable_progress_bar=false"])
    trainer = out.trainer
    assert trainer.current_epoch == 3 and trainer.global_step == 6  # 4 steps restored, 2 more taken
    names = {type(c).__module__ for c in trainer.callbacks}
    assert {"callbacks.measurement.knn", "callbacks.measurement.online_probe.probe",
            "callbacks.reliability.exact_resume"} <= names
    saved = torch.load(OLD_RUN / "last.ckpt", map_location="cpu", weights_only=True)
    restored = MaskedAutoencoder.load_from_checkpoint(OLD_RUN / "last.ckpt", map_location="cpu")
    assert all(torch.equal(restored.state_dict()[f"network.{k}"], v) for k, v in saved["state_dict"].items())
    assert "knn/top1" in trainer.callback_metrics
