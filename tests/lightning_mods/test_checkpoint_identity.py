"""A checkpoint rebuilds exactly the network that wrote it (items 1 and 2): the
resolved shortcut weights travel in the state_dict, the schedule and architecture in the
hyper-parameters, and every consumer uses them or refuses in one line."""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from commands import lightning_cli as cli
from lightning_mods.checkpointing.rebuild import build_module
from lightning_mods.linear_probe import LinearProbe
from lightning_mods.backbone.residual import residual_blocks, shortcut_alphas, timm_state_dict
from lightning_mods.backbone.residual_mlp import ResidualMLP
from lightning_mods.backbone.resnet import ResNet18Cifar
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.uvit import UViT
from lightning_mods.backbone.vit import DecayedVisionTransformer

VIT = dict(img_size=16, patch_size=8, embed_dim=16, depth=3, num_heads=2, num_classes=3)


def linear_alphas(num_sublayers: int, alpha_min: float) -> np.ndarray:
    """The linear schedule by hand in float64: 1 - k / (K - 1) * (1 - alpha_min)."""
    return 1.0 - np.arange(num_sublayers, dtype=np.float64) / (num_sublayers - 1) * (1.0 - alpha_min)


BACKBONES = {
    "vit": (lambda s: DecayedVisionTransformer(s, zero_init_branches=False, **VIT), lambda: torch.randn(2, 3, 16, 16)),
    "resnet": (lambda s: ResNet18Cifar(shortcut=s, zero_init_branches=False, channels=(4, 4, 8, 8), num_classes=3),
               lambda: torch.randn(2, 3, 16, 16)),
    "uvit": (lambda s: UViT(img_size=8, patch_size=4, in_chans=1, embed_dim=16, depth=2, num_heads=2, shortcut=s),
             None),
    "mlp": (lambda s: ResidualMLP(depth=5, width=4, shortcut=s), lambda: torch.randn(7, 2)),
}


def run(name: str, model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(0)
    with torch.no_grad():
        if name == "uvit":
            return model(torch.randn(2, 1, 8, 8), torch.tensor([3, 500]))
        return model(BACKBONES[name][1]())


@pytest.mark.parametrize("name", list(BACKBONES))
def test_a_state_dict_alone_sets_the_writers_shortcut_weights(name):
    build = BACKBONES[name][0]
    torch.manual_seed(0)
    writer = build(ShortcutSchedule("linear", 0.6)).eval()
    reader = build(ShortcutSchedule("linear", 1.0)).eval()
    assert run(name, writer).ne(run(name, reader)).any()
    with pytest.warns(UserWarning, match=r"shortcut weights are not those of .*alpha_min=1\.0.* the loaded weights are "
                                         r"used") as record:
        reader.load_state_dict(writer.state_dict(), strict=True)
    assert len([w for w in record if "shortcut weights" in str(w.message)]) == 1  # one line, not one per block
    np.testing.assert_array_equal(shortcut_alphas(reader), linear_alphas(writer.num_sublayers, 0.6))
    assert torch.equal(run(name, reader), run(name, writer))  # bit for bit


def test_loading_weights_of_the_same_schedule_is_silent():
    writer = DecayedVisionTransformer(ShortcutSchedule("linear", 0.6), **VIT)
    reader = DecayedVisionTransformer(ShortcutSchedule("linear", 0.6), **VIT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reader.load_state_dict(writer.state_dict())


def test_shortcut_entries_stay_float64_whatever_the_model_dtype():
    model = DecayedVisionTransformer(ShortcutSchedule("linear", 0.6), **VIT).to(torch.bfloat16)
    entry = model.state_dict()["blocks.1.shortcut_weights"]
    assert entry.dtype == torch.float64
    np.testing.assert_array_equal(entry[:, 0].numpy(), linear_alphas(6, 0.6)[2:4])


def test_stock_timm_weights_load_strictly_into_the_standard_network_only():
    torch.manual_seed(0)
    stock = VisionTransformer(**VIT).eval()
    ours = DecayedVisionTransformer(ShortcutSchedule("linear", 1.0), zero_init_branches=False, **VIT).eval()
    ours.load_state_dict(stock.state_dict(), strict=True)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(ours(x), stock(x))
    decayed = DecayedVisionTransformer(ShortcutSchedule("linear", 0.6), **VIT)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "blocks.0.shortcut_weights"'):
        decayed.load_state_dict(stock.state_dict(), strict=True)
    with pytest.raises(ValueError, match="timm_state_dict: blocks.0 has decayed or learnable shortcuts"):
        timm_state_dict(decayed)
    assert set(timm_state_dict(decayed, force=True)) == set(stock.state_dict())


# --- checkpoints of the LightningModules, as `shortcutlab fit` writes them -----------------------
MAE_NETWORK = {"class_path": "lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT",
               "init_args": dict(img_size=16, in_chans=1, patch_size=8, embed_dim=16, depth=2, num_heads=2,
                                 decoder_embed_dim=8, decoder_depth=1, decoder_num_heads=2)}
MAE = {"class_path": "lightning_mods.mae.MaskedAutoencoder", "init_args": {"network": MAE_NETWORK, "num_reconstructions": 0}}
FAMILIES = {
    "mae": MAE,
    "classifier": {"class_path": "lightning_mods.classifier.ImageClassifier",
                   "init_args": {"num_classes": 10, "in_chans": 1, "network": {
                       "class_path": "lightning_mods.backbone.resnet.ResNet18Cifar",
                       "init_args": {"channels": [4, 4, 8, 8], "zero_init_branches": False}}}},
    "diffusion": {"class_path": "lightning_mods.diffusion.DiffusionModule",
                  "init_args": {"network": {"class_path": "lightning_mods.backbone.uvit.UViT", "init_args": dict(
                      img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2)},
                      "num_sample_images": 0}},
    "spiral": {"class_path": "lightning_mods.spiral_classifier.SpiralClassifier", "init_args": {"network": {
        "class_path": "lightning_mods.backbone.residual_mlp.ResidualMLP", "init_args": dict(depth=4, width=4)}}},
}


def with_shortcut(config: dict, alpha_min: float) -> dict:
    shortcut = {"class_path": "lightning_mods.backbone.shortcut.ShortcutSchedule",
                "init_args": {"kind": "linear", "alpha_min": alpha_min}}
    init = dict(config["init_args"])
    held = "network" if "network" in init else None
    if held:  # the network the recipe holds
        init[held] = {**init[held], "init_args": {**init[held]["init_args"], "shortcut": shortcut}}
    else:
        init["shortcut"] = shortcut
    return {**config, "init_args": init}


def write_checkpoint(path: Path, config: dict, alpha_min: float) -> torch.nn.Module:
    """What `shortcutlab fit` writes: hyper-parameters with ``_class_path``, the state_dict."""
    torch.manual_seed(0)
    module, _ = build_module(with_shortcut(config, alpha_min))
    for p in module.parameters():  # trained-looking weights: no zero-initialised branch left
        p.data.normal_(0, 0.1)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": "2.6.0"}, path)
    return module.eval()


def features(module, name: str) -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(3, 2) if name == "spiral" else torch.randn(3, 1, 16 if name in ("mae", "classifier") else 8,
                                                                  16 if name in ("mae", "classifier") else 8)
    with torch.no_grad():
        return module.forward_features(x)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_consumer_rebuilds_the_network_that_wrote_the_checkpoint(name, tmp_path):
    path = tmp_path / f"{name}.ckpt"
    writer = write_checkpoint(path, FAMILIES[name], 0.6)
    want = features(writer, name)
    loaded = type(writer).load_from_checkpoint(path, map_location="cpu", weights_only=True).eval()
    probe = LinearProbe(checkpoint=str(path), num_classes=3)
    for module in (loaded, probe.backbone):
        assert torch.equal(features(module, name), want)
        np.testing.assert_array_equal(shortcut_alphas(module), linear_alphas(len(shortcut_alphas(writer)), 0.6))
    probed = MAE_NETWORK if name == "mae" else FAMILIES[name]  # the MAE's network alone
    assert probe.hparams.backbone["class_path"] == probed["class_path"]


def test_probe_of_an_alpha_one_checkpoint_with_an_alpha_0_6_setting_is_refused(tmp_path):
    """The old failure: an alpha_min 1.0 checkpoint probed with a config saying 0.6 measured
    another network; now the checkpoint alone gives 1.0 and a disagreeing setting is an error."""
    path = tmp_path / "mae_alpha1.ckpt"
    writer = write_checkpoint(path, MAE, 1.0)
    given = {"init_args": {"shortcut": {"init_args": {"alpha_min": 0.6}}}}  # the probe's backbone: the MAE's network
    with pytest.raises(ValueError, match=r"^backbone.shortcut.alpha_min: 0.6 given, checkpoint .* has 1.0") as err:
        LinearProbe(backbone=given, checkpoint=str(path), num_classes=3)
    assert "\n" not in str(err.value)
    probe = LinearProbe(checkpoint=str(path), num_classes=3)
    assert shortcut_alphas(probe.backbone) == [1.0] * 4
    assert torch.equal(features(probe.backbone, "mae"), features(writer, "mae"))
    with pytest.warns(UserWarning, match="allow_override"):
        other = LinearProbe(backbone=given, checkpoint=str(path), num_classes=3, allow_override=True)
    # on purpose: the 0.6 schedule with the checkpoint's other weights
    np.testing.assert_array_equal(shortcut_alphas(other.backbone), linear_alphas(4, 0.6))
    assert not torch.equal(features(other.backbone, "mae"), features(writer, "mae"))


def test_probe_of_a_checkpoint_written_before_the_shortcut_entries(tmp_path):
    """Older checkpoints have the schedule only in hyper_parameters: the probe fills the entries
    from it; a bare strict load into the decayed network still refuses them."""
    path = tmp_path / "old.ckpt"
    writer = write_checkpoint(path, MAE, 0.6)
    ckpt = torch.load(path, weights_only=True)
    ckpt["state_dict"] = {k: v for k, v in ckpt["state_dict"].items() if not k.endswith("shortcut_weights")}
    torch.save(ckpt, path)
    probe = LinearProbe(checkpoint=str(path), num_classes=3)
    np.testing.assert_array_equal(shortcut_alphas(probe.backbone), linear_alphas(4, 0.6))
    assert torch.equal(features(probe.backbone, "mae"), features(writer, "mae"))
    with pytest.raises(RuntimeError, match="encoder.blocks.0.shortcut_weights"):
        build_module(MAE)[0].load_state_dict(ckpt["state_dict"])


TINY_MAE = ["--model=lightning_mods.mae.MaskedAutoencoder", "--model.network.patch_size=8",
            "--model.network.embed_dim=16", "--model.network.depth=2", "--model.network.num_heads=2",
            "--model.network.decoder_embed_dim=8", "--model.network.decoder_depth=1",
            "--model.network.decoder_num_heads=2", "--model.init_args.num_reconstructions=0"]
DIGITS = ["--data=datamodules.digits.Digits", "--data.init_args.batch_size=32", "--data.init_args.image_size=16"]


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_ckpt_path_of_another_class_is_a_one_line_error(subcommand, tmp_path):
    path = tmp_path / "classifier.ckpt"
    write_checkpoint(path, FAMILIES["classifier"], 0.6)
    with pytest.raises(ValueError) as err:
        cli.main([subcommand, *TINY_MAE, *DIGITS, f"--ckpt_path={path}", "--trainer.max_epochs=1",
                  f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert cli.root_message(err.value) == (
        f"--ckpt_path: {str(path)!r} is a checkpoint of lightning_mods.classifier.ImageClassifier, the model is "
        "lightning_mods.mae.MaskedAutoencoder; give the config the checkpoint was trained with")
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_ckpt_path_with_other_settings_or_weights_is_a_one_line_error(tmp_path):
    path = tmp_path / "mae_alpha1.ckpt"
    writer = write_checkpoint(path, MAE, 1.0)
    base = ["validate", *TINY_MAE, *DIGITS, f"--ckpt_path={path}", f"--trainer.default_root_dir={tmp_path / 'run'}"]
    with pytest.raises(ValueError) as err:  # a config that sets the schedule (unset, the checkpoint's is taken)
        cli.main([*base, "--model.network.shortcut.alpha_min=0.6"])
    assert cli.root_message(err.value).startswith(
        f"--ckpt_path: model.network.shortcut.alpha_min: 0.6 in the config, checkpoint {str(path)!r} has 1.0")
    with pytest.raises(ValueError) as err:  # geometry linked from the data: the first differing weight
        cli.main([*base, "--model.network.shortcut.alpha_min=1.0", "--data.init_args.image_size=24"])
    assert "does not fit the model: network.encoder.pos_embed is (1, 5, 16) there and (1, 10, 16) here" in \
        cli.root_message(err.value)
    out = cli.main([*base, "--model.network.shortcut.alpha_min=1.0", "--trainer.limit_val_batches=1",
                    "--trainer.enable_progress_bar=false", "--trainer.logger=false"])
    assert shortcut_alphas(out.model) == [1.0] * 4 and "val/loss" in out.trainer.callback_metrics
    assert torch.equal(features(out.model.cpu().eval(), "mae"), features(writer, "mae"))


def without_class_path(path: Path) -> Path:
    """The checkpoint as ``Trainer.fit`` in Python writes it: hyper-parameters name no class."""
    ckpt = torch.load(path, weights_only=True)
    ckpt["hyper_parameters"].pop("_class_path", None)
    torch.save(ckpt, path)
    return path


def test_ckpt_path_written_outside_the_cli_is_checked_against_the_config_too(tmp_path):
    """No _class_path: the config's class is taken, and the checkpoint's settings, then its
    weights, must agree with the config (one-line errors), as for a checkpoint of the CLI."""
    path = tmp_path / "python_mae.ckpt"
    writer = write_checkpoint(path, MAE, 1.0)
    without_class_path(path)
    base = ["validate", *TINY_MAE, *DIGITS, f"--ckpt_path={path}", f"--trainer.default_root_dir={tmp_path / 'run'}"]
    with pytest.raises(ValueError) as err:  # a config that sets the schedule (unset, the checkpoint's is taken)
        cli.main([*base, "--model.network.shortcut.alpha_min=0.6"])
    assert cli.root_message(err.value).startswith(
        f"--ckpt_path: model.network.shortcut.alpha_min: 0.6 in the config, checkpoint {str(path)!r} has 1.0")
    other = tmp_path / "python_classifier.ckpt"
    write_checkpoint(other, FAMILIES["classifier"], 0.6)
    without_class_path(other)
    with pytest.raises(ValueError) as err:
        cli.main(["validate", *TINY_MAE, *DIGITS, f"--ckpt_path={other}", f"--trainer.default_root_dir={tmp_path}"])
    message = cli.root_message(err.value)  # a classifier's settings (base_lr ...) differ first
    assert message.startswith("--ckpt_path: model.") and str(other) in message and "\n" not in message
    out = cli.main([*base, "--model.network.shortcut.alpha_min=1.0", "--trainer.limit_val_batches=1",
                    "--trainer.enable_progress_bar=false", "--trainer.logger=false"])
    assert torch.equal(features(out.model.cpu().eval(), "mae"), features(writer, "mae"))


def test_console_command_exits_2_on_a_checkpoint_of_another_class(tmp_path, warm_shortcutlab):
    """Through a process of its own (the warm CLI's, tests/helpers/fork_server.py): status 2, one line."""
    import os

    path = tmp_path / "classifier.ckpt"
    write_checkpoint(path, FAMILIES["classifier"], 0.6)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([*warm_shortcutlab, "fit", *TINY_MAE, *DIGITS, f"--ckpt_path={path}",
                          f"--trainer.default_root_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "shortcutlab: error: --ckpt_path: ") and "ImageClassifier" in out.stderr
    assert not (tmp_path / "run").exists()


def test_probe_diffusion_rebuilds_the_model_from_its_checkpoint(tmp_path):
    from commands.probe_diffusion import load_model_and_data

    config = str(Path(__file__).resolve().parents[2] / "configs" / "digits_diffusion_quick.yaml")
    small = ["--model.network.depth=2", "--model.network.embed_dim=16", "--model.network.num_heads=2",
             "--model.init_args.feature_block=1"]
    writer, _ = load_model_and_data(config, None, small)
    for p in writer.parameters():
        p.data.normal_(0, 0.1)
    path = tmp_path / "diffusion.ckpt"
    torch.save({"state_dict": writer.state_dict(), "hyper_parameters": dict(writer.hparams)}, path)
    images = torch.randn(2, 1, writer.network.img_size, writer.network.img_size)
    with torch.no_grad():
        want = writer.eval().noised_block_features(images, [0, 1, 2], 50, seed=0)
    module, _ = load_model_and_data(config, str(path), small)
    np.testing.assert_array_equal(shortcut_alphas(module), linear_alphas(6, 0.7))  # 3 blocks in, mid, out
    with torch.no_grad():
        got = module.eval().noised_block_features(images, [0, 1, 2], 50, seed=0)
    assert all(torch.equal(u, v) for u, v in zip(got, want))
    with pytest.raises(ValueError, match=r"^model.network.shortcut.alpha_min: 1.0 given, checkpoint .* has 0.7"):
        load_model_and_data(config, str(path), [*small, "--model.network.shortcut.alpha_min=1.0"])
