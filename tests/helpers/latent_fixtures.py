"""A small random AutoencoderKL and the digits encoded with it, for latent-diffusion tests and
for pointing the latent configs at something that exists (``latent_dir``, ``vae_path``)."""
from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL

from commands.encode_latents import main as encode_latents

TINY_VAE_SCALE = 0.5
TINY_VAE_SHIFT = 0.1


def make_tiny_vae(path: str | Path, channels: int = 1, seed: int = 0) -> AutoencoderKL:
    """``channels`` x 8 x 8 images <-> 4 x 4 x 4 latents (two blocks: downsampling by 2), saved to ``path``."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(in_channels=channels, out_channels=channels, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=8, scaling_factor=TINY_VAE_SCALE,
                        shift_factor=TINY_VAE_SHIFT)
    vae.save_pretrained(path)
    return vae.eval()


def make_tiny_latents(root: str | Path) -> dict:
    """``root/vae`` (1-channel tiny VAE) and ``root/latents`` (digits at 8x8, with mirrored copies).

    Returns ``vae`` (the model), ``vae_path``, ``latent_dir`` and the ``metadata`` written.
    """
    root = Path(root)
    vae = make_tiny_vae(root / "vae")
    metadata = encode_latents(["--vae-path", str(root / "vae"), "--data", "datamodules.digits.Digits",
                               "--data.image_size", "8", "--out", str(root / "latents"), "--hflip", "true",
                               "--batch-size", "256", "--part-size", "512", "--device", "cpu"])
    return {"vae": vae, "vae_path": str(root / "vae"), "latent_dir": str(root / "latents"), "metadata": metadata}
