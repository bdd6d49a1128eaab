"""Noise schedules and samplers of the diffusion model, from diffusers (SPEC section 3: linear
VP noise schedule, 1000-step sampler; U-ViT's latent models sample with DPM-Solver).

Training noises with ``DDPMScheduler.add_noise``: ``x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps``
with ``abar_t = prod_{s<=t} (1 - beta_s)``. Samplers, picked by name:

- ``ddpm``: ancestral sampling (Ho et al. 2020), ``DDPMScheduler``;
- ``ddim``: deterministic DDIM (eta 0), ``DDIMScheduler``;
- ``dpmsolver++``: second-order multistep DPM-Solver++, ``DPMSolverMultistepScheduler``.

Fewer steps than training timesteps use "trailing" spacing, so sampling starts at ``t = T - 1``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

SAMPLERS: tuple[str, ...] = ("ddpm", "ddim", "dpmsolver++")
BETA_SCHEDULES: tuple[str, ...] = ("linear", "scaled_linear", "squaredcos_cap_v2")


def check_schedule(num_train_timesteps: int, beta_schedule: str, beta_start: float, beta_end: float) -> None:
    """One-line ``ValueError`` naming the first bad field."""
    if num_train_timesteps < 2:
        raise ValueError(f"num_train_timesteps must be >= 2, got {num_train_timesteps}")
    if beta_schedule not in BETA_SCHEDULES:
        raise ValueError(f"beta_schedule must be one of {', '.join(BETA_SCHEDULES)}; got {beta_schedule!r}")
    if not 0.0 < beta_start < beta_end < 1.0:
        raise ValueError(f"beta_start and beta_end must satisfy 0 < beta_start < beta_end < 1, "
                         f"got {beta_start} and {beta_end}")


def check_sampler(sampler: str, num_steps: int, num_train_timesteps: int) -> None:
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}; got {sampler!r}")
    if not 1 <= num_steps <= num_train_timesteps:
        raise ValueError(f"num_sampling_steps must be in [1, {num_train_timesteps}], got {num_steps}")
    if sampler == "ddim" and num_train_timesteps % num_steps:
        # diffusers' DDIM steps back by T // steps, which with trailing spacing misses the next
        # timestep when steps does not divide T: samples drift even with the exact noise
        raise ValueError(f"num_sampling_steps for ddim must divide num_train_timesteps ({num_train_timesteps}), "
                         f"got {num_steps}")


def schedule_config(num_train_timesteps: int = 1000, beta_schedule: str = "linear", beta_start: float = 1e-4,
                    beta_end: float = 0.02) -> dict:
    """The keyword arguments every diffusers scheduler here shares."""
    check_schedule(num_train_timesteps, beta_schedule, beta_start, beta_end)
    return {"num_train_timesteps": num_train_timesteps, "beta_schedule": beta_schedule,
            "beta_start": beta_start, "beta_end": beta_end, "prediction_type": "epsilon"}


def training_scheduler(config: dict):  # -> diffusers.DDPMScheduler
    """The forward-noising scheduler (``add_noise``) of training."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(**config)


def make_sampler(name: str, config: dict, clip_sample: bool, clip_range: float = 1.0):
    """A fresh diffusers scheduler for one sampling run (they keep per-run state)."""
    from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler

    if name == "ddpm":
        return DDPMScheduler(**config, variance_type="fixed_small", clip_sample=clip_sample,
                             clip_sample_range=clip_range, timestep_spacing="trailing")
    if name == "ddim":
        return DDIMScheduler(**config, clip_sample=clip_sample, clip_sample_range=clip_range,
                             set_alpha_to_one=True, timestep_spacing="trailing")
    if name == "dpmsolver++":
        return DPMSolverMultistepScheduler(**config, algorithm_type="dpmsolver++", solver_order=2,
                                           lower_order_final=True, timestep_spacing="trailing")
    raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}; got {name!r}")


def run_sampler(predict_noise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], noise: torch.Tensor,
                scheduler, num_steps: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Denoise ``noise`` (``x_T``) in ``num_steps`` steps; ``predict_noise(x_t, t) -> eps``."""
    scheduler.set_timesteps(num_steps, device=noise.device)
    x = noise * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        eps = predict_noise(scheduler.scale_model_input(x, t), t).float()
        x = scheduler.step(eps, t, x, generator=generator).prev_sample
    return x
