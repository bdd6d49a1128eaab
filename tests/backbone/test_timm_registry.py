"""The decayed backbones in timm's registry (docs/checkpoints.md, "timm by name"):
``timm.create_model`` builds them by name with the schedule asked for, and loads an encoder
exported by ``convert_mae export-encoder`` into the same function as the MAE that wrote it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch

import lightning_mods.backbone  # noqa: F401 (registers the models)
from lightning_mods.backbone.residual import shortcut_alphas
from lightning_mods.backbone.resnet import ResNet50d
from lightning_mods.backbone.vit import DecayedVisionTransformer
from lightning_mods.mae import MaskedAutoencoder

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "tests" / "data" / "written_by_0_1_0" / "last.ckpt"


def linear_alphas(num_sublayers: int, alpha_min: float) -> np.ndarray:
    """alpha_k = 1 - k / (K - 1) * (1 - alpha_min), in float64."""
    k = np.arange(num_sublayers, dtype=np.float64)
    return 1.0 - k / (num_sublayers - 1) * (1.0 - alpha_min)


def test_a_decayed_vit_base_by_name():
    model = timm.create_model("vit_base_patch16_224_decayed", alpha_min=0.6, num_classes=0)
    assert isinstance(model, DecayedVisionTransformer)
    assert (model.embed_dim, len(model.blocks), model.patch_embed.patch_size) == (768, 12, (16, 16))
    np.testing.assert_allclose(shortcut_alphas(model), linear_alphas(24, 0.6), rtol=0, atol=1e-12)


def test_the_other_names_and_the_schedule_arguments():
    assert "vit_base_patch16_224_decayed" in timm.list_models("*_decayed")
    resnet = timm.create_model("resnet50d_decayed", kind="cosine", alpha_min=0.8, num_classes=3)
    assert isinstance(resnet, ResNet50d) and resnet.fc.out_features == 3
    assert resnet.shortcut.kind == "cosine" and min(shortcut_alphas(resnet)) == pytest.approx(0.8)
    standard = timm.create_model("vit_tiny_patch16_224_decayed", alpha_min=1.0)
    assert set(shortcut_alphas(standard)) == {1.0}


def test_an_exported_encoder_loads_into_the_same_function(tmp_path):
    out = tmp_path / "encoder.pth"
    subprocess.run([sys.executable, "-m", "commands.convert_mae", "export-encoder", str(CHECKPOINT), str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    mae = MaskedAutoencoder.load_from_checkpoint(CHECKPOINT, map_location="cpu").eval()
    hp = mae.network.settings
    model = timm.create_model("vit_base_patch16_224_decayed", pretrained=True, pretrained_cfg_overlay={"file": str(out)},
                              img_size=hp["img_size"], patch_size=hp["patch_size"], embed_dim=hp["embed_dim"],
                              depth=hp["depth"], num_heads=hp["num_heads"], in_chans=hp["in_chans"], num_classes=0,
                              final_norm=False).eval()
    np.testing.assert_allclose(shortcut_alphas(model), shortcut_alphas(mae.network.encoder), rtol=0, atol=0)
    images = torch.randn(4, hp["in_chans"], hp["img_size"], hp["img_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(images).mean(dim=1), mae.forward_features(images),
                                   rtol=0, atol=0)
    with pytest.raises(ValueError, match=f"embed_dim={hp['embed_dim']}"):  # another architecture is refused, not half loaded
        timm.create_model("vit_base_patch16_224_decayed", pretrained=True, pretrained_cfg_overlay={"file": str(out)},
                          img_size=hp["img_size"], patch_size=hp["patch_size"], embed_dim=2 * hp["embed_dim"],
                          depth=hp["depth"], num_heads=hp["num_heads"], in_chans=hp["in_chans"], num_classes=0,
                          final_norm=False)


def test_a_resnet_s_weights_load_with_a_new_head_for_other_classes(tmp_path):
    """As timm's own loader: a head for another number of classes is made anew, every other weight
    comes from the file, and a file that lacks one of those is refused in one line."""
    torch.manual_seed(0)
    trained = timm.create_model("resnet18_cifar_decayed", num_classes=10)
    torch.save(trained.state_dict(), tmp_path / "resnet.pth")
    model = timm.create_model("resnet18_cifar_decayed", num_classes=3, pretrained=True,
                              pretrained_cfg_overlay={"file": str(tmp_path / "resnet.pth")})
    assert model.fc.out_features == 3
    for name, value in model.state_dict().items():
        if not name.startswith("fc."):
            assert torch.equal(value, trained.state_dict()[name]), name
    state = trained.state_dict()
    del state["layer1.0.conv1.weight"]
    torch.save(state, tmp_path / "resnet.pth")
    with pytest.raises(ValueError, match=r"leaves 1 weights at their initial value \(layer1.0.conv1.weight\)"):
        timm.create_model("resnet18_cifar_decayed", num_classes=3, pretrained=True,
                          pretrained_cfg_overlay={"file": str(tmp_path / "resnet.pth")})
