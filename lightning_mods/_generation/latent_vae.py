"""The frozen VAE of latent diffusion (the decay paper, section 5, ImageNet-100: a pretrained VAE's 32x32x4
latents; Rombach et al. 2022).

The VAE is diffusers' ``AutoencoderKL`` loaded from a local folder written by
``save_pretrained`` (nothing is downloaded). Latents the diffusion model sees are
``(z - shift_factor) * scaling_factor`` of the posterior sample/mean ``z``; pixels are in
``[-1, 1]`` at the VAE's input and output.

:class:`FrozenVAE` keeps the VAE outside the LightningModule's module tree: it is not trained,
not saved in checkpoints, not averaged by the EMA callback, and deep copies share it.
"""
from __future__ import annotations

import os
from typing import Optional

import torch


def load_vae(path: str | os.PathLike):  # -> diffusers.AutoencoderKL
    """``AutoencoderKL.from_pretrained(path)`` of a local folder, frozen and in eval mode."""
    from diffusers import AutoencoderKL

    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"vae_path: no AutoencoderKL folder at {path!r} (expected config.json and weights "
                         "written by save_pretrained)")
    vae = AutoencoderKL.from_pretrained(path, local_files_only=True, low_cpu_mem_usage=False)
    vae.requires_grad_(False)
    return vae.eval()


class FrozenVAE:
    """A frozen ``AutoencoderKL`` that follows the device of its callers.

    Args:
        path: local ``save_pretrained`` folder.
        scaling_factor: latent scale (None: the VAE config's ``scaling_factor``).
        shift_factor: latent shift (None: the VAE config's ``shift_factor`` or 0).
    """

    def __init__(self, path: str | os.PathLike, scaling_factor: Optional[float] = None,
                 shift_factor: Optional[float] = None) -> None:
        self.vae = load_vae(path)
        config = self.vae.config
        self.scaling_factor = float(scaling_factor if scaling_factor is not None else config.scaling_factor)
        config_shift = getattr(config, "shift_factor", None)
        self.shift_factor = float(shift_factor if shift_factor is not None else (config_shift or 0.0))
        self.latent_channels = int(config.latent_channels)
        self.image_channels = int(config.in_channels)
        self.downsample_factor = 2 ** (len(config.block_out_channels) - 1)

    def __deepcopy__(self, memo: dict) -> "FrozenVAE":
        return self  # shared, never averaged or copied

    def _to(self, device: torch.device) -> None:
        if next(self.vae.parameters()).device != device:
            self.vae.to(device)

    @torch.no_grad()
    def encode_moments(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[-1, 1]`` pixels -> unscaled posterior ``(mean, std)``, float32."""
        self._to(pixels.device)
        posterior = self.vae.encode(pixels.float()).latent_dist
        return posterior.mean.float(), posterior.std.float()

    def scale(self, z: torch.Tensor) -> torch.Tensor:
        """Unscaled latent -> the diffusion model's latent."""
        return (z - self.shift_factor) * self.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The diffusion model's latents -> ``[-1, 1]`` pixels (float32, not clamped)."""
        self._to(latents.device)
        z = latents.float() / self.scaling_factor + self.shift_factor
        return self.vae.decode(z).sample.float()
