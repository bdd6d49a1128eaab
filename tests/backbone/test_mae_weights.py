"""docs/checkpoints.md ("timm by name"): both MAE repositories' files load through timm
(``checkpoint_filter_fn`` and ``pretrained=True, pretrained_cfg_overlay=dict(file=...)``) into
the registered MAE, and their encoder half into ``vit_*_decayed``, computing what the repositories' own code computes (the
references of tests/helpers/mae_references.py); a file that does not fill the network is refused in one
line naming the argument that would match, and an exported encoder rebuilds from the call its
export prints."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import timm
import torch

import lightning_mods.backbone  # noqa: F401 (registers the networks)
from commands.convert_mae import main as convert_main
from lightning_mods.backbone.mae_weights import checkpoint_filter_fn
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.mae import MaskedAutoencoder
from helpers.mae_references import AuthorsMAE, OfficialMAE, randomise_

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "tests" / "data" / "written_by_0_1_0" / "last.ckpt"
DIMS = dict(img_size=16, patch_size=4, in_chans=3, embed_dim=32, num_heads=4, decoder_embed_dim=16,
            decoder_num_heads=2)
AUTHORS = dict(depth=4, decoder_depth=2, min_decay=0.6)
OFFICIAL = dict(depth=3, decoder_depth=2)


def references() -> dict[str, torch.nn.Module]:
    return {"authors": randomise_(AuthorsMAE(**DIMS, **AUTHORS), seed=1),
            "official": randomise_(OfficialMAE(**DIMS, **OFFICIAL), seed=2)}


def registered_mae(layout: str, **kwargs) -> MaskedAutoencoderViT:
    """The registered MAE with the arguments of the reference ``layout``."""
    arch = dict(img_size=16, patch_size=4, embed_dim=32, num_heads=4, decoder_embed_dim=16, decoder_num_heads=2)
    if layout == "authors":
        arch.update(depth=4, decoder_depth=2, alpha_min=0.6)
    else:
        arch.update(depth=3, decoder_depth=2, unet_skips=False, alpha_min=1.0)
    return timm.create_model("mae_vit_tiny_patch4_32_decayed", **{**arch, **kwargs})


def write(path: Path, ref: torch.nn.Module, kind: str) -> Path:
    """``ref``'s weights as the repositories write them: ``checkpoint`` (their training loop's,
    DDP-prefixed, with optimizer and args), ``visualize`` (``{'model': all}``) or ``pretrain``
    (``{'model': encoder}``, the released ``mae_pretrain_vit_*.pth``)."""
    state = ref.state_dict()
    if kind == "checkpoint":
        args = argparse.Namespace(min_decay=0.6, norm_pix_loss=True, mask_ratio=0.75)
        torch.save({"model": {f"module.{k}": v for k, v in state.items()}, "optimizer": {"state": {}},
                    "epoch": 3, "args": args}, path)
    elif kind == "visualize":
        torch.save({"model": state}, path)
    else:
        encoder = ("cls_token", "pos_embed", "patch_embed.", "blocks.", "norm.")
        torch.save({"model": {k: v for k, v in state.items() if k.startswith(encoder)}}, path)
    return path


def same_outputs(net: MaskedAutoencoderViT, ref: torch.nn.Module) -> None:
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss, pred, mask = net(images, generator=torch.Generator().manual_seed(3))
        ref_loss, ref_pred, ref_mask = ref(images, torch.rand(2, 16, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(mask, ref_mask)
    torch.testing.assert_close(pred, ref_pred, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["authors", "official"])
@pytest.mark.parametrize("kind", ["checkpoint", "visualize"])
def test_a_repository_s_file_loads_through_timm_and_computes_its_outputs(tmp_path, layout, kind):
    ref = references()[layout].eval()
    path = write(tmp_path / f"{kind}.pth", ref, kind)
    net = registered_mae(layout, pretrained=True, pretrained_cfg_overlay=dict(file=str(path))).eval()
    same_outputs(net, ref)
    # the filter alone gives exactly what a strict load of the network takes
    fresh = registered_mae(layout).eval()
    fresh.load_state_dict(checkpoint_filter_fn(torch.load(path, weights_only=False), fresh), strict=True)
    same_outputs(fresh, ref)


@pytest.mark.parametrize("layout,final_norm,kind", [("authors", False, "checkpoint"), ("official", True, "checkpoint"),
                                                    ("official", True, "pretrain")])  # the authors released no encoder alone
def test_the_encoder_half_loads_into_a_decayed_vit(tmp_path, layout, final_norm, kind):
    """As timm's ``vit_base_patch16_224.mae`` loads He et al.'s encoder: the decoder dropped, the
    shortcut weights from the schedule asked for, the features the repository's own."""
    ref = references()[layout].eval()
    path = write(tmp_path / f"{kind}.pth", ref, kind)
    vit = timm.create_model("vit_tiny_patch16_224_decayed", pretrained=True,
                            pretrained_cfg_overlay=dict(file=str(path)), img_size=16, patch_size=4, embed_dim=32,
                            depth=AUTHORS["depth"] if layout == "authors" else OFFICIAL["depth"], num_heads=4,
                            num_classes=0, final_norm=final_norm, alpha_min=0.6 if layout == "authors" else 1.0).eval()
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(vit.forward_features(images).mean(dim=1), ref.features(images),
                                   rtol=1e-5, atol=1e-6)


def test_a_file_that_leaves_weights_unset_is_refused_naming_the_argument(tmp_path):
    refs = references()
    authors = write(tmp_path / "authors.pth", refs["authors"], "checkpoint")
    official = write(tmp_path / "official.pth", refs["official"], "visualize")
    with pytest.raises(ValueError, match=r"leaves 2 weights at their initial value \(norm.weight, norm.bias\).*"
                                         r"final_norm=False") as err:
        timm.create_model("vit_tiny_patch16_224_decayed", pretrained=True, pretrained_cfg_overlay=dict(file=str(authors)),
                          img_size=16, patch_size=4, embed_dim=32, depth=4, num_heads=4, num_classes=0)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unet_skips=False"):  # He et al.'s file into the skip decoder
        registered_mae("authors", pretrained=True, pretrained_cfg_overlay=dict(file=str(official)))
    with pytest.raises(ValueError, match="depth=4"):
        registered_mae("authors", depth=2, pretrained=True, pretrained_cfg_overlay=dict(file=str(authors)))
    with pytest.raises(ValueError, match="encoder_final_norm=True"):
        checkpoint_filter_fn(torch.load(official, weights_only=True),
                             registered_mae("official", encoder_final_norm=False))


def test_an_exported_encoder_rebuilds_from_the_call_its_export_prints(tmp_path, capsys):
    out = tmp_path / "encoder.pth"
    convert_main(["export-encoder", str(CHECKPOINT), str(out)])
    printed = capsys.readouterr().out
    call = re.search(r"(timm\.create_model\(.*\))$", printed.strip()).group(1)
    for name in ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "mlp_ratio", "final_norm",
                 "shortcut"):
        assert f"{name}=" in call, name
    vit = eval(call, {"timm": timm}).eval()  # noqa: S307 (the printed call, as a user pastes it)
    mae = MaskedAutoencoder.load_from_checkpoint(CHECKPOINT, map_location="cpu").eval()
    hp = mae.network
    images = torch.randn(3, hp.in_chans, hp.img_size, hp.img_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(vit.forward_features(images).mean(dim=1), mae.forward_features(images),
                                   rtol=0, atol=0)
    wrong = call.replace("final_norm=False", "final_norm=True")
    assert wrong != call
    with pytest.raises(ValueError, match="final_norm=False"):
        eval(wrong, {"timm": timm})  # noqa: S307
