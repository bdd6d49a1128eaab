"""Latent diffusion (the decay paper, section 5, ImageNet-100 on VAE latents) with a small random
AutoencoderKL saved to a temporary folder: encoding once, reading back, decoding."""
import copy

import pytest
import torch
from lightning.pytorch import Trainer

from datamodules.digits import Digits
from datamodules.latents import Latents
from lightning_mods.diffusion import DiffusionModule
from commands.encode_latents import to_vae_input

from helpers.latent_fixtures import TINY_VAE_SCALE as SCALE, make_tiny_latents
from lightning_mods.backbone.uvit import UViT


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """A 1-channel VAE (8x8 -> 4 x 4x4) and the digits at 8x8 encoded with mirrored copies."""
    made = make_tiny_latents(tmp_path_factory.mktemp("latents"))
    return {"vae": made["vae"], "vae_path": made["vae_path"], "dir": made["latent_dir"], "metadata": made["metadata"]}


def digits_pixels(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` train digits at 8x8 in [-1, 1] and their labels (as the encoder reads them)."""
    dm = Digits(image_size=8)
    dm.setup("fit")
    images = torch.stack([dm.bank_dataset[i][0] for i in range(n)])
    labels = torch.stack([torch.as_tensor(dm.bank_dataset[i][1]) for i in range(n)])
    return (images * dm.std[0] + dm.mean[0]).clamp(0, 1) * 2 - 1, labels


def test_the_parts_hold_the_vae_posterior_of_each_image_and_its_mirror(encoded):
    meta = encoded["metadata"]
    assert meta["latent_channels"] == 4 and meta["latent_size"] == 4 and meta["num_classes"] == 10
    assert meta["scaling_factor"] == SCALE and meta["shift_factor"] == pytest.approx(0.1) and meta["hflip"]
    assert meta["splits"]["train"]["num_samples"] == 1437 and meta["splits"]["val"]["num_samples"] == 360
    assert [s["num_samples"] for s in meta["splits"]["train"]["parts"]] == [512, 512, 413]
    part = torch.load(f"{encoded['dir']}/train_00000.pt", weights_only=True)
    pixels, labels = digits_pixels(6)
    with torch.no_grad():
        posterior = encoded["vae"].encode(pixels).latent_dist
        mirrored = encoded["vae"].encode(pixels.flip(-1)).latent_dist
    assert part["mean"].dtype == torch.float16 and part["mean"].shape == (512, 4, 4, 4)
    torch.testing.assert_close(part["mean"][:6].float(), posterior.mean, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(part["std"][:6].float(), posterior.std, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(part["flip_mean"][:6].float(), mirrored.mean, rtol=2e-3, atol=2e-3)
    assert torch.equal(part["labels"][:6], labels)


def test_latents_datamodule_follows_the_contract(encoded):
    dm = Latents(encoded["dir"], batch_size=32)
    assert (dm.num_classes, dm.image_size, dm.in_chans, dm.scaling_factor) == (10, 4, 4, SCALE)
    assert dm.mean == (0.0,) * 4 and dm.std == (1.0,) * 4 and dm.random_flip
    dm.setup("fit")
    assert len(dm.bank_dataset) == 1437 and len(dm.val_dataset) == 360
    part = torch.load(f"{encoded['dir']}/train_00001.pt", weights_only=True)
    latent, label = dm.bank_dataset[512 + 7]  # the second part
    torch.testing.assert_close(latent, (part["mean"][7].float() - 0.1) * SCALE, rtol=0, atol=0)
    assert label == part["labels"][7]
    torch.manual_seed(0)
    draws = torch.stack([dm.train_dataset[519][0] for _ in range(64)])
    assert draws.std(0).mean() > 0  # posterior samples, half of them of the mirror
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (32, 4, 4, 4) and images.dtype == torch.float32 and labels.dtype == torch.int64
    plain = Latents(encoded["dir"], sample_posterior=False, random_flip=False)
    plain.setup("fit")
    torch.testing.assert_close(plain.train_dataset[519][0], latent, rtol=0, atol=0)


def test_latent_round_trip_decodes_with_the_same_vae(encoded):
    dm = Latents(encoded["dir"])
    dm.setup("validate")
    module = DiffusionModule(UViT(img_size=4, in_chans=4, patch_size=2, embed_dim=32, depth=2, num_heads=4, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}), vae_path=encoded["vae_path"])
    assert module.is_latent and not module.clip_sample and module.vae.scaling_factor == SCALE
    latents = torch.stack([dm.val_dataset[i][0] for i in range(4)])
    assert torch.equal(module.to_model_space(latents), latents)
    part = torch.load(f"{encoded['dir']}/val_00000.pt", weights_only=True)
    with torch.no_grad():
        expected = ((encoded["vae"].decode(part["mean"][:4].float()).sample + 1) / 2).clamp(0, 1)
    pixels = module.to_pixels(latents)
    assert pixels.shape == (4, 1, 8, 8)
    torch.testing.assert_close(pixels, expected, rtol=0, atol=1e-5)
    # the VAE is not part of the module: not trained, not checkpointed, shared by deep copies
    assert not any("vae" in k for k in module.state_dict())
    assert copy.deepcopy(module).vae is module.vae


def test_latent_diffusion_trains_and_generates_pixels(encoded, tmp_path):
    torch.manual_seed(0)
    dm = Latents(encoded["dir"], batch_size=16)
    module = DiffusionModule(UViT(img_size=4, in_chans=4, patch_size=2, embed_dim=32, depth=2, num_heads=4, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}, num_classes=10), num_classes=10, class_conditional=True, vae_path=encoded["vae_path"], sampler="dpmsolver++", num_sampling_steps=3, num_sample_images=0, warmup_steps=0)
    trainer = Trainer(max_steps=2, limit_val_batches=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=dm)
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    images = module.generate_images(3, torch.tensor([0, 1, 2]), seed=0, guidance_scale=1.5)
    assert images.shape == (3, 1, 8, 8) and images.min() >= 0 and images.max() <= 1
    assert module.forward_features(torch.stack([dm.val_dataset[i][0] for i in range(3)])).shape == (3, 32)


def test_mismatches_raise_one_line_errors(encoded, tmp_path):
    with pytest.raises(ValueError, match="in_chans"):
        DiffusionModule(UViT(img_size=4, in_chans=3, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}), vae_path=encoded["vae_path"])
    with pytest.raises(ValueError, match="vae_path"):
        DiffusionModule(UViT(img_size=4, in_chans=4, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}), vae_path=str(tmp_path))
    module = DiffusionModule(UViT(img_size=4, in_chans=4, patch_size=2, embed_dim=32, depth=2, num_heads=4, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}), vae_path=encoded["vae_path"], latent_scaling_factor=0.18215)
    with pytest.raises(ValueError, match="latent_scaling_factor"):
        module.set_pixel_stats(Latents(encoded["dir"]))
    shifted = Latents(encoded["dir"])
    shifted.shift_factor += 0.25  # latents from a VAE with another shift than the model's
    with pytest.raises(ValueError, match="vae_path: this VAE shifts latents by"):
        DiffusionModule(UViT(img_size=4, in_chans=4, patch_size=2, embed_dim=32, depth=2, num_heads=4, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}), vae_path=encoded["vae_path"]).set_pixel_stats(shifted)
    with pytest.raises(FileNotFoundError, match="metadata.json"):
        Latents(str(tmp_path))
    with pytest.raises(ValueError, match="data"):
        to_vae_input(torch.zeros(1, 2, 4, 4), torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1), 3)
    grey = to_vae_input(torch.zeros(1, 1, 4, 4), torch.full((1, 1, 1, 1), 0.5), torch.ones(1, 1, 1, 1), 3)
    assert grey.shape == (1, 3, 4, 4) and torch.all(grey == 0)


def test_a_folder_encoded_before_the_part_files_were_named_so_still_reads(encoded, tmp_path):
    """metadata.json of release 0.2 lists each split's files under "shards"."""
    import json
    import shutil

    old = tmp_path / "old_latents"
    shutil.copytree(encoded["dir"], old)
    meta = json.loads((old / "metadata.json").read_text())
    for split in meta["splits"].values():
        split["shards"] = split.pop("parts")
    (old / "metadata.json").write_text(json.dumps(meta))
    now, before = Latents(encoded["dir"], batch_size=32), Latents(str(old), batch_size=32)
    now.setup("fit")
    before.setup("fit")
    assert len(before.bank_dataset) == len(now.bank_dataset) == 1437
    torch.testing.assert_close(before.bank_dataset[600][0], now.bank_dataset[600][0], rtol=0, atol=0)
