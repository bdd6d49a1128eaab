"""Every config in configs/ parses and runs ``fit`` for one step, with data roots pointed at
files generated in the real on-disk formats (tests/conftest.py). Diffusion configs need a VAE,
latents and an FID extractor and are run, with ``validate`` too, in test_diffusion_configs.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import cli

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.yaml")
                 if "lightning_mods.diffusion.DiffusionModule" not in p.read_text())


def data_section(config: Path) -> tuple[str, dict]:
    """``(class_path, init_args)`` of a config's datamodule."""
    cfg = yaml.safe_load(config.read_text()) or {}
    data = cfg.get("data") or {}
    if not isinstance(data, dict):
        return str(data), {}
    return data.get("class_path", ""), data.get("init_args") or {}


def test_there_are_configs():
    assert len(CONFIGS) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_fit_one_step(config, tmp_path, data_roots):
    overrides = data_roots(*data_section(config))
    args = ["fit", f"--config={config}", *overrides,
            "--trainer.fast_dev_run=1", "--trainer.accelerator=cpu", "--trainer.devices=1",
            "--trainer.num_nodes=1", "--trainer.precision=32-true", "--trainer.strategy=auto",
            "--trainer.sync_batchnorm=false",
            f"--trainer.default_root_dir={tmp_path / 'run'}"]
    cli.main(args)
