"""Every diffusion config in configs/ runs ``fit`` for one step and ``validate`` from the
checkpoint it wrote, FID included (issue 5).

The configs' own models and callbacks are used as written; only what cannot exist here is
pointed elsewhere: data roots (files generated in the real formats by tests/conftest.py),
the VAE and its latents (tests/latent_fixtures.py), the Inception extractor (a registered
tiny one, tests/tiny_feature_extractor.py), and the sizes of sampling and FID runs.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import cli
from latent_fixtures import make_tiny_latents
from tiny_feature_extractor import register_tiny_extractor

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DIFFUSION_CONFIGS = sorted(p for p in CONFIG_DIR.glob("*.yaml")
                           if "lightning_mods.diffusion.DiffusionModule" in p.read_text())


@pytest.fixture(scope="module")
def tiny_latents(tmp_path_factory):
    return make_tiny_latents(tmp_path_factory.mktemp("diffusion_config_latents"))


def point_at_test_data(config: dict, tmp_path: Path, data_root: dict, latents: dict) -> dict:
    """A copy of ``config`` whose data, VAE, FID extractor and sampling sizes work offline in seconds."""
    data = config["data"]["init_args"]
    data.update(batch_size=4, num_workers=0)
    name = config["data"]["class_path"].rsplit(".", 1)[-1]
    if name in ("CIFAR10", "CIFAR100"):
        data.update(data_dir=str(data_root["root"]), download=False)
    elif name == "Latents":
        data.update(latent_dir=latents["latent_dir"])
        data.pop("pin_memory", None)
        config["model"]["init_args"]["vae_path"] = latents["vae_path"]
    model = config["model"]["init_args"]
    model.update(num_sampling_steps=2, num_sample_images=4)
    for callback in config["trainer"].get("callbacks", []):
        if callback["class_path"] != "callbacks.fid.GenerationMetrics":
            continue
        fid = callback.setdefault("init_args", {})
        fid.update(num_samples=8, batch_size=4, num_sampling_steps=2, num_reference=8,
                   feature_extractor=register_tiny_extractor(), feature_extractor_weights_path=None,
                   cache_root=str(tmp_path / "fid_cache"))
        if fid.get("reference"):
            fid["reference"]["init_args"].update(
                data_dir=str(data_root["imagenet"]), class_list=str(data_root["imagenet_class_list"]),
                image_size=8, batch_size=4, num_workers=0)
    return config


@pytest.mark.slow
@pytest.mark.parametrize("config_path", DIFFUSION_CONFIGS, ids=[p.stem for p in DIFFUSION_CONFIGS])
def test_fit_one_step_then_validate_from_checkpoint(config_path, tmp_path, data_root, tiny_latents):
    config = point_at_test_data(yaml.safe_load(config_path.read_text()), tmp_path, data_root, tiny_latents)
    test_config = tmp_path / config_path.name
    test_config.write_text(yaml.safe_dump(config))
    common = [f"--config={test_config}", "--trainer.accelerator=cpu", "--trainer.devices=1",
              "--trainer.num_nodes=1", "--trainer.strategy=auto", "--trainer.precision=32-true",
              "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path / 'run'}",
              "--trainer.limit_val_batches=1"]
    fitted = cli.main(["fit", *common, "--trainer.max_steps=1", "--trainer.max_epochs=1",
                       "--trainer.limit_train_batches=1", "--trainer.check_val_every_n_epoch=1"])
    assert torch.isfinite(fitted.trainer.callback_metrics["train/loss"])
    # the config's own ModelCheckpoint(save_last=True) wrote it; a second copy would cost
    # another 2 GB for U-ViT-Mid (weights, EMA and AdamW state)
    ckpt = Path(fitted.trainer.checkpoint_callback.last_model_path)
    assert ckpt.is_file()

    validated = cli.main(["validate", *common, f"--ckpt_path={ckpt}"])
    metrics = validated.trainer.callback_metrics
    assert torch.isfinite(metrics["val/loss"])
    if "callbacks.fid.GenerationMetrics" in config_path.read_text():
        assert torch.isfinite(metrics["val/fid"]) and metrics["val/fid"] >= 0
