"""Every config in configs/ parses and runs ``fit`` for one step, with data roots pointed at
files generated in the real on-disk formats (tests/conftest.py). Diffusion configs need a VAE,
latents and an FID extractor and are run, with ``validate`` too, in test_diffusion_configs.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from commands import lightning_cli as cli

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


def probe_checkpoint(config: Path, folder: Path) -> list[str]:
    """A linear-probe config takes its backbone from a checkpoint: a tiny MAE one of the data's geometry."""
    if "lightning_mods.linear_probe.LinearProbe" not in config.read_text():
        return []
    import torch

    from lightning_mods.checkpoint import build_module

    class_path, init = data_section(config)
    size = int(init.get("image_size", 32))
    module, _ = build_module({"class_path": "lightning_mods.mae.MaskedAutoencoder", "init_args": dict(
        image_size=size, in_chans=1 if class_path.endswith(("Digits", "MNIST")) else 3, patch_size=size // 2,
        embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=8, decoder_depth=1, decoder_num_heads=2)})
    path = folder / "backbone.ckpt"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return [f"--model.init_args.checkpoint={path}"]


def test_there_are_configs():
    assert len(CONFIGS) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_fit_one_step(config, tmp_path, data_roots):
    overrides = data_roots(*data_section(config)) + probe_checkpoint(config, tmp_path / "ckpt")
    args = ["fit", f"--config={config}", *overrides,
            "--trainer.fast_dev_run=1", "--trainer.accelerator=cpu", "--trainer.devices=1",
            "--trainer.num_nodes=1", "--trainer.precision=32-true", "--trainer.strategy=auto",
            "--trainer.sync_batchnorm=false",
            f"--trainer.default_root_dir={tmp_path / 'run'}"]
    cli.main(args)
