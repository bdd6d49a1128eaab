"""Checkpoint interchange (commands/convert_mae.py): small checkpoints in the three foreign
layouts (key names and shapes of the authors' and He et al.'s repositories, via the references of
tests/helpers/mae_references.py, and of timm's VisionTransformer) are converted and must compute what
the foreign model computes; export-timm loads strictly into timm and round-trips."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

from commands import lightning_cli as cli
from commands.convert_mae import main as convert_main
from lightning_mods.linear_probe import LinearProbe
from lightning_mods.mae import MaskedAutoencoder
from helpers.mae_references import AuthorsMAE, OfficialMAE, randomise_

ROOT = Path(__file__).resolve().parents[2]
DIMS = dict(img_size=16, patch_size=4, in_chans=3, embed_dim=32, num_heads=4, decoder_embed_dim=16,
            decoder_num_heads=2)
HEADS = ["--num-heads=4", "--decoder-num-heads=2"]


def convert(*argv: str) -> None:
    convert_main(list(argv))


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got - want).abs().max() <= 1e-6 * want.abs().max(), (got - want).abs().max()


def same_as_reference(ckpt: Path, ref, images: torch.Tensor) -> MaskedAutoencoder:
    model = MaskedAutoencoder.load_from_checkpoint(ckpt, map_location="cpu", weights_only=True)
    loss, pred, mask = model(images, generator=torch.Generator().manual_seed(3))
    ref_loss, ref_pred, ref_mask = ref(images, torch.rand(2, 16, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(mask, ref_mask)
    close(pred, ref_pred)
    close(loss, ref_loss)
    close(model.forward_features(images), ref.features(images))
    return model


@pytest.mark.parametrize("decoder_depth", [2, 1])  # 1: the authors' second SkipLayer never runs
def test_authors_checkpoint_with_args(tmp_path, decoder_depth):
    ref = randomise_(AuthorsMAE(**DIMS, depth=4, decoder_depth=decoder_depth, min_decay=0.6), seed=1)
    args = argparse.Namespace(min_decay=0.6, norm_pix_loss=True, mask_ratio=0.75, model="mae_vit_tiny")
    src = tmp_path / "checkpoint-last.pth"
    torch.save({"model": ref.state_dict(), "epoch": 3, "args": args}, src)
    convert("import", str(src), str(tmp_path / "mae.ckpt"), *HEADS)
    images = torch.randn(2, 3, 16, 16)
    model = same_as_reference(tmp_path / "mae.ckpt", ref, images)
    hp = model.hparams.network["init_args"]
    assert hp["unet_skips"] and not hp["encoder_final_norm"] and hp["shortcut"]["alpha_min"] == 0.6
    assert [hp[k] for k in ("depth", "decoder_depth", "img_size", "patch_size", "embed_dim")] == [4, decoder_depth, 16,
                                                                                                   4, 32]


def test_authors_checkpoint_without_args_needs_alpha_min(tmp_path, capsys):
    ref = randomise_(AuthorsMAE(**DIMS, depth=4, decoder_depth=2, min_decay=0.7, norm_pix_loss=False), seed=2)
    # no args in the file: the converter takes the repositories' parser default, norm_pix_loss off
    src = tmp_path / "bare.pth"
    torch.save(ref.state_dict(), src)
    with pytest.raises(SystemExit) as exit_info:
        convert("import", str(src), str(tmp_path / "mae.ckpt"), *HEADS)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--alpha-min" in err and err.count("\n") == 1
    assert not (tmp_path / "mae.ckpt").exists()
    convert("import", str(src), str(tmp_path / "mae.ckpt"), *HEADS, "--alpha-min=0.7")
    same_as_reference(tmp_path / "mae.ckpt", ref, torch.randn(2, 3, 16, 16))


def test_official_checkpoint_and_timm_export(tmp_path):
    ref = randomise_(OfficialMAE(**DIMS, depth=3, decoder_depth=2, norm_pix_loss=False), seed=3)
    src = tmp_path / "mae_visualize.pth"
    torch.save({"model": {f"module.{k}": v for k, v in ref.state_dict().items()}}, src)  # DDP prefix too
    convert("import", str(src), str(tmp_path / "mae.ckpt"), *HEADS)
    images = torch.randn(2, 3, 16, 16)
    model = same_as_reference(tmp_path / "mae.ckpt", ref, images)
    assert not model.network.unet_skips and model.network.encoder_final_norm
    # export: strict load into timm's own VisionTransformer, same tokens as our encoder
    convert("export-timm", str(tmp_path / "mae.ckpt"), str(tmp_path / "vit.pth"))
    vit = VisionTransformer(img_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=3, num_heads=4,
                            num_classes=0).eval()
    vit.load_state_dict(torch.load(tmp_path / "vit.pth", weights_only=True), strict=True)
    with torch.no_grad():
        close(vit.forward_features(images).mean(1), model.forward_features(images))
        close(vit.forward_features(images).mean(1), ref.features(images))


def test_timm_mae_weights_import_and_round_trip(tmp_path, capsys):
    torch.manual_seed(0)
    vit = randomise_(VisionTransformer(img_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=3, num_heads=4,
                                       num_classes=0), seed=4).eval()
    src = tmp_path / "model.safetensors"  # what timm's hub download is
    save_file({k: v.contiguous() for k, v in vit.state_dict().items()}, str(src))
    with pytest.raises(SystemExit):
        convert("import", str(src), str(tmp_path / "mae.ckpt"), "--num-heads=4")
    assert "--new-decoder" in capsys.readouterr().err
    convert("import", str(src), str(tmp_path / "mae.ckpt"), "--num-heads=4", "--new-decoder",
            "--decoder-embed-dim=16", "--decoder-depth=1", "--decoder-num-heads=2")
    model = MaskedAutoencoder.load_from_checkpoint(tmp_path / "mae.ckpt", map_location="cpu", weights_only=True)
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        close(model.forward_features(images), vit.forward_features(images).mean(1))
    convert("export-timm", str(tmp_path / "mae.ckpt"), str(tmp_path / "back.pth"))
    back = torch.load(tmp_path / "back.pth", weights_only=True)
    assert back.keys() == vit.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in vit.state_dict().items())


def test_decayed_export_needs_consent_and_loads_into_timm_without_final_norm(tmp_path, capsys):
    ref = randomise_(AuthorsMAE(**DIMS, depth=4, decoder_depth=2, min_decay=0.6), seed=5)
    torch.save({"model": ref.state_dict()}, tmp_path / "a.pth")
    convert("import", str(tmp_path / "a.pth"), str(tmp_path / "mae.ckpt"), *HEADS, "--alpha-min=0.6")
    with pytest.raises(SystemExit):
        convert("export-timm", str(tmp_path / "mae.ckpt"), str(tmp_path / "vit.pth"))
    assert "--allow-decayed" in capsys.readouterr().err
    convert("export-timm", str(tmp_path / "mae.ckpt"), str(tmp_path / "vit.pth"), "--allow-decayed")
    vit = VisionTransformer(img_size=16, patch_size=4, in_chans=3, embed_dim=32, depth=4, num_heads=4,
                            num_classes=0, final_norm=False)
    vit.load_state_dict(torch.load(tmp_path / "vit.pth", weights_only=True), strict=True)


def test_converted_checkpoint_validates_and_probes(tmp_path):
    """The shortcutlab entry points accept an imported checkpoint: validate --ckpt_path and LinearProbe."""
    ref = randomise_(OfficialMAE(img_size=16, patch_size=8, in_chans=1, embed_dim=32, depth=2, num_heads=2,
                                 decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2), seed=6)
    torch.save({"model": ref.state_dict()}, tmp_path / "official.pth")
    ckpt = tmp_path / "mae.ckpt"
    convert("import", str(tmp_path / "official.pth"), str(ckpt), "--num-heads=2", "--decoder-num-heads=2")
    # the config must describe the checkpoint's network (another one is a one-line error)
    arch = ["--model.network.patch_size=8", "--model.network.embed_dim=32", "--model.network.depth=2", "--model.network.num_heads=2",
            "--model.network.decoder_embed_dim=16", "--model.network.decoder_depth=1", "--model.network.decoder_num_heads=2",
            "--model.network.unet_skips=false", "--model.network.norm_pix_loss=false", "--model.network.shortcut.alpha_min=1.0"]
    out = cli.main(["validate", "--model=lightning_mods.mae.MaskedAutoencoder", *arch, "--data=datamodules.digits.Digits",
                    "--data.init_args.batch_size=32", "--data.init_args.image_size=16", f"--ckpt_path={ckpt}",
                    "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false",
                    "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}"])
    assert "val/loss" in out.trainer.callback_metrics
    assert torch.equal(out.model.network.encoder.blocks[1].mlp.fc2.weight, ref.blocks[1].mlp.fc2.weight)
    probe = LinearProbe(checkpoint=str(ckpt), num_classes=10)  # the backbone comes from the checkpoint
    assert torch.equal(probe.backbone.encoder.norm.weight, ref.norm.weight)


@pytest.mark.parametrize("argv,field", [
    (["import", "missing.pth", "out.ckpt"], "no file"),
    (["import", "{src}", "out.ckpt", "--layout=authors"], "layout"),
    (["import", "{src}", "out.ckpt", "--alpha-min=0.6"], "alpha_min"),
    (["import", "{src}", "out.ckpt", "--num-heads=5"], "--num-heads"),
    (["import", "{src}", "out.ckpt"], "--num-heads"),  # width 32 has no default head count
    (["import", "{src}", "out.ckpt", "--num-heads=4", "--new-decoder"], "new_decoder"),
    (["export-timm", "{src}", "out.pth"], "has no 'state_dict'; expected a Lightning .ckpt"),
])
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, argv, field):
    ref = OfficialMAE(**DIMS, depth=2, decoder_depth=1)
    src = tmp_path / "official.pth"
    torch.save({"model": ref.state_dict()}, src)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        convert(*[a.format(src=src) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert field in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.ckpt").exists() and not (tmp_path / "out.pth").exists()


def test_python_dash_m_entry_point(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "commands.convert_mae", "import", "missing.pth", "out.ckpt"],
                         cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 2 and res.stderr.startswith("shortcutlab convert-mae: error: source: no file"), res.stderr


def test_export_of_a_checkpoint_whose_weights_do_not_fit_is_one_line(tmp_path, capsys):
    ref = OfficialMAE(**DIMS, depth=2, decoder_depth=1)
    torch.save({"model": ref.state_dict()}, tmp_path / "official.pth")
    convert("import", str(tmp_path / "official.pth"), str(tmp_path / "mae.ckpt"), *HEADS)
    ckpt = torch.load(tmp_path / "mae.ckpt", weights_only=True)
    del ckpt["state_dict"]["network.encoder.blocks.1.mlp.fc2.weight"]
    torch.save(ckpt, tmp_path / "mae.ckpt")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        convert("export-timm", str(tmp_path / "mae.ckpt"), str(tmp_path / "vit.pth"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert "does not fit the MaskedAutoencoder: missing network.encoder.blocks.1.mlp.fc2.weight" in err
    assert not (tmp_path / "vit.pth").exists()


def test_outputs_into_folders_that_do_not_exist_yet_are_made(tmp_path, capsys):
    """``--help`` says missing folders are created; a file in the folder's place is one line."""
    ref = randomise_(OfficialMAE(**DIMS, depth=3, decoder_depth=2, norm_pix_loss=False), seed=3)
    torch.save({"model": ref.state_dict()}, tmp_path / "mae.pth")
    convert("import", str(tmp_path / "mae.pth"), str(tmp_path / "new" / "deeper" / "mae.ckpt"), *HEADS)
    same_as_reference(tmp_path / "new" / "deeper" / "mae.ckpt", ref, torch.randn(2, 3, 16, 16))
    convert("export-timm", str(tmp_path / "new" / "deeper" / "mae.ckpt"), str(tmp_path / "out" / "vit.pth"))
    assert (tmp_path / "out" / "vit.pth").is_file()
    (tmp_path / "blocker").write_text("a file where a folder should be")
    with pytest.raises(SystemExit) as stop:
        convert("export-timm", str(tmp_path / "new" / "deeper" / "mae.ckpt"), str(tmp_path / "blocker" / "vit.pth"))
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"shortcutlab convert-mae: error: cannot write {tmp_path / 'blocker' / 'vit.pth'}: File exists"]
    for command in ("import", "export-timm"):  # what --help says
        with pytest.raises(SystemExit):
            convert(command, "--help")
        assert "missing folders are created" in " ".join(capsys.readouterr().out.split()), command
