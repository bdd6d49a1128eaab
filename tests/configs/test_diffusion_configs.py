"""Every diffusion composition of configs/compositions.yaml (and single-file diffusion config)
runs ``fit`` for one step and ``validate`` from the checkpoint it wrote, FID included.

The compositions' own models and callbacks are used as resolved by LightningCLI; only what cannot exist here is
pointed elsewhere: data roots (files generated in the real formats by tests/conftest.py),
the VAE and its latents (tests/helpers/latent_fixtures.py), the Inception extractor (a registered
tiny one, tests/helpers/tiny_feature_extractor.py), and the sizes of sampling and FID runs.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from commands import lightning_cli as cli
from helpers.composed_configs import (CONFIG_DIR, ROWS, SINGLE_FILES, command_args, is_diffusion, representatives,
                              narrow_settings, resolved_config, sizes)
from helpers.latent_fixtures import make_tiny_latents
from helpers.tiny_feature_extractor import register_tiny_extractor

DIFFUSION_RUNS = [n for n in list(ROWS) + SINGLE_FILES if is_diffusion(n)]
# the U-ViT-Mid rows on VAE latents run from tests/configs/test_latent_diffusion_configs.py: a
# file of their own, so the suite's two workers share the slowest rows
LATENT_RUNS = [n for n in DIFFUSION_RUNS if "latent" in n]


@pytest.fixture(scope="module")
def tiny_latents(tmp_path_factory):
    return make_tiny_latents(tmp_path_factory.mktemp("diffusion_config_latents"))


def point_at_test_data(config: dict, tmp_path: Path, data_root: dict, latents: dict) -> dict:
    """A copy of ``config`` whose data, VAE, FID extractor and sampling sizes work offline in seconds."""
    data = config["data"]["init_args"]
    # evaluation batches of 64: kNN embeds its whole bank (2874 tiny latents) through the
    # real-size network, where a batch's fixed cost outweighs its images
    data.update(batch_size=4, eval_batch_size=64, num_workers=0)
    name = config["data"]["class_path"].rsplit(".", 1)[-1]
    if name in ("CIFAR10", "CIFAR100"):
        data.update(data_dir=str(data_root["root"]), download=False)
    elif name == "Latents":
        data.update(latent_dir=latents["latent_dir"], pin_memory=False)
        config["model"]["init_args"]["vae_path"] = latents["vae_path"]
    model = config["model"]["init_args"]
    model.update(num_sampling_steps=2, num_sample_images=4)
    for callback in config["trainer"].get("callbacks", []):
        if callback["class_path"] != "callbacks.measurement.fid.GenerationMetrics":
            continue
        fid = callback.setdefault("init_args", {})
        fid.update(num_samples=4, batch_size=4, num_sampling_steps=2, num_reference=4,
                   report_num_samples=4 if fid.get("report_num_samples") else None, report_num_sampling_steps=2,
                   feature_extractor=register_tiny_extractor(), feature_extractor_weights_path=None,
                   cache_root=str(tmp_path / "fid_cache"))
        if fid.get("reference"):
            fid["reference"]["init_args"].update(
                data_dir=str(data_root["imagenet"]), class_list=str(data_root["imagenet_class_list"]),
                image_size=8, batch_size=4, num_workers=0)
    return config


@pytest.mark.slow
@pytest.mark.parametrize("name, full_size", sizes(representatives([n for n in DIFFUSION_RUNS if n not in LATENT_RUNS])))
def test_fit_one_step_then_validate_from_checkpoint(name, full_size, tmp_path, data_root, tiny_latents):
    fit_one_step_then_validate(name, full_size, tmp_path, data_root, tiny_latents)


def fit_one_step_then_validate(name: str, full_size: bool, tmp_path: Path, data_root: dict, tiny_latents: dict) -> None:
    config = point_at_test_data(resolved_config(command_args(name)), tmp_path, data_root, tiny_latents)
    if not full_size:  # a narrow copy of the network: the row's composition, training and FID, not its size
        narrow = narrow_settings("DiffusionModule")
        config["model"]["init_args"]["network"]["init_args"].update(narrow["network"])
        config["model"]["init_args"].update(narrow["init_args"])
    test_config = tmp_path / "config.yaml"
    test_config.write_text(yaml.safe_dump(config))
    common = [f"--config={test_config}", "--trainer.accelerator=cpu", "--trainer.devices=1",
              "--trainer.num_nodes=1", "--trainer.strategy=auto", "--trainer.precision=32-true",
              "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path / 'run'}",
              "--trainer.limit_val_batches=1", "--trainer.val_check_interval=1"]
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
    if any(c["class_path"] == "callbacks.measurement.fid.GenerationMetrics" for c in config["trainer"]["callbacks"]):
        assert torch.isfinite(metrics["val/fid"]) and metrics["val/fid"] >= 0


def readme_init_and_decay() -> dict[str, tuple[str, str]]:
    """``row or file -> (residual branches at init, weight decay)`` from the table in configs/README.md."""
    rows = {}
    for line in (CONFIG_DIR / "README.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] in ("zero", "U-ViT's"):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


@pytest.mark.parametrize("name", DIFFUSION_RUNS)
def test_init_and_weight_decay_are_what_the_readme_says(name):
    """Each config's own settings, on a narrow copy of its model: zeroed branch outputs or not, and
    which parameters AdamW decays."""
    from types import SimpleNamespace

    from lightning_mods.backbone.shortcut import ShortcutSchedule
    from lightning_mods.backbone.uvit import UViT
    from lightning_mods.diffusion import DiffusionModule

    init, decay = readme_init_and_decay()[name]
    args = dict(resolved_config(command_args(name))["model"]["init_args"])
    network = {k: v for k, v in args.pop("network")["init_args"].items() if k not in ("norm_layer", "act_layer")}
    network["shortcut"] = ShortcutSchedule(**network["shortcut"]["init_args"])
    network.update(embed_dim=16, depth=2, num_heads=2, in_chans=4, img_size=8,
                   num_classes=3 if args.get("class_conditional") else 0)
    args.update(vae_path=None, num_classes=3, feature_block=None)
    torch.manual_seed(0)
    module = DiffusionModule(UViT(**network), **args)
    module.trainer = SimpleNamespace(estimated_stepping_batches=10, world_size=1, accumulate_grad_batches=1,
                                     datamodule=SimpleNamespace(batch_size=args.get("reference_batch") or 1))
    for blk in module.network.blocks_in_depth_order():
        zeroed = [torch.count_nonzero(layer.weight).item() == 0 for layer in (blk.attn.proj, blk.mlp.fc2)]
        assert zeroed == [init == "zero"] * 2, name
    optimizer = module.configure_optimizers()["optimizer"]
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {n for n, p in module.network.named_parameters() if id(p) in decayed}
    everything = {n for n, p in module.network.named_parameters() if p.requires_grad}
    if decay == "all parameters":
        assert names == everything
    else:
        assert decay == "weights only" and "pos_embed" not in names and "in_blocks.0.norm1.weight" not in names
        assert "in_blocks.0.attn.qkv.weight" in names
