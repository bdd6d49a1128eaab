"""Every config in configs/ parses and runs ``fit`` for one step, with data roots pointed at
files generated in the real on-disk formats (tests/conftest.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import cli

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.yaml"))


def data_class_path(config: Path) -> str:
    """The datamodule class of a config (following a ``base:`` style multi-file layout if any)."""
    cfg = yaml.safe_load(config.read_text()) or {}
    data = cfg.get("data") or {}
    return data.get("class_path", "") if isinstance(data, dict) else str(data)


def test_there_are_configs():
    assert len(CONFIGS) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_fit_one_step(config, tmp_path, data_roots):
    overrides = data_roots(data_class_path(config), tmp_path)
    args = ["fit", f"--config={config}", *overrides,
            "--trainer.fast_dev_run=1", "--trainer.accelerator=cpu", "--trainer.devices=1",
            "--trainer.num_nodes=1", "--trainer.precision=32-true", "--trainer.strategy=auto",
            f"--trainer.default_root_dir={tmp_path / 'run'}"]
    cli.main(args)
