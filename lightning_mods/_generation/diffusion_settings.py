"""The settings of :class:`lightning_mods.diffusion.DiffusionModule` checked together, and the parts it
builds from them: one-line errors for settings that cannot work together, the class conditioning of
its network, the block its evaluation features come from, the frozen VAE of latent mode."""
from __future__ import annotations

from typing import Optional, Sequence

from lightning_mods._generation.latent_vae import FrozenVAE
from lightning_mods.backbone.uvit import UViT

LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")


def check_settings(class_conditional: bool, num_classes: int, label_dropout: float, guidance_scale: float,
                   lr_schedule: str, reference_batch: Optional[int], num_sample_images: int, feature_timestep: int,
                   num_train_timesteps: int, in_chans: int, pixel_mean: Optional[Sequence[float]],
                   pixel_std: Optional[Sequence[float]]) -> None:
    """One-line errors for :class:`DiffusionModule` settings that cannot work together."""
    if class_conditional and num_classes <= 0:
        raise ValueError(f"num_classes must be > 0 for a class-conditional model, got {num_classes}")
    if not 0.0 <= label_dropout <= 1.0:
        raise ValueError(f"label_dropout must be in [0, 1], got {label_dropout}")
    if guidance_scale < 0.0:
        raise ValueError(f"guidance_scale must be >= 0 (1 = no guidance), got {guidance_scale}")
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}; got {lr_schedule!r}")
    if reference_batch is not None and reference_batch <= 0:
        raise ValueError(f"reference_batch must be > 0 or null, got {reference_batch}")
    if num_sample_images < 0:
        raise ValueError(f"num_sample_images must be >= 0, got {num_sample_images}")
    if not 0 <= feature_timestep < num_train_timesteps:
        raise ValueError(f"feature_timestep must be in [0, {num_train_timesteps - 1}], got {feature_timestep}")
    for name, stats in (("pixel_mean", pixel_mean), ("pixel_std", pixel_std)):
        if stats is not None and len(stats) != in_chans:
            raise ValueError(f"{name} needs {in_chans} value(s), one per channel, got {len(stats)}")


def middle_block(num_blocks: int, feature_block: Optional[int]) -> int:
    """The block the evaluation features come from: ``feature_block``, else the middle one."""
    block = num_blocks // 2 if feature_block is None else feature_block
    if not 0 <= block < num_blocks:
        raise ValueError(f"feature_block must be in [0, {num_blocks - 1}], got {feature_block}")
    return block


def latent_vae(vae_path: str, scaling_factor: Optional[float], in_chans: int) -> FrozenVAE:
    """The frozen VAE of latent mode, whose latent channels must be the network's ``in_chans``."""
    vae = FrozenVAE(vae_path, scaling_factor=scaling_factor)
    if vae.latent_channels != in_chans:
        raise ValueError(f"in_chans ({in_chans}) must equal the VAE's latent_channels "
                         f"({vae.latent_channels}) in latent mode")
    return vae


def check_conditioning(network: UViT, class_conditional: bool, num_classes: int) -> None:
    """A class-conditional model's network embeds the data's classes; an unconditional one's none."""
    if class_conditional and network.num_classes != num_classes:
        raise ValueError(f"network.num_classes is {network.num_classes}; a class-conditional model's network embeds the "
                         f"data's {num_classes} classes")
    if not class_conditional and network.num_classes:
        raise ValueError(f"network.num_classes is {network.num_classes}, but class_conditional is false: the class "
                         "embeddings would never be trained (set class_conditional: true, or num_classes: 0)")
