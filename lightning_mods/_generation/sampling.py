"""Noise processes and samplers of the diffusion model (the decay paper, section 5: linear VP noise schedule,
1000-step sampler; U-ViT's latent models sample with DPM-Solver).

Two noise processes, picked by ``noise_process``:

- ``discrete`` (DDPM; U-ViT's latent ``train_ldm_discrete.py``): integer timesteps ``t`` uniform
  over the ``T`` training timesteps, ``x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps`` with
  ``abar_t = prod_{s<=t} (1 - beta_s)`` (``DDPMScheduler.add_noise``); the network sees ``t``.
- ``vp_sde`` (U-ViT's pixel CIFAR runs, ``sde.py``): continuous ``t ~ U(0, 1)`` on the linear VP
  SDE with ``beta(t)`` from ``T * beta_start`` to ``T * beta_end`` (0.1 to 20 with the defaults);
  the network sees ``t * 999`` (:mod:`lightning_mods._generation.vp_sde`).

Samplers, picked by name:

- ``ddpm``: ancestral sampling (Ho et al. 2020), ``DDPMScheduler``;
- ``ddim``: deterministic DDIM (eta 0), ``DDIMScheduler``;
- ``dpmsolver++``: second-order multistep DPM-Solver++, ``DPMSolverMultistepScheduler``;
- ``dpmsolver++_singlestep``: third-order single-step DPM-Solver++ (U-ViT's latent sampler),
  ``DPMSolverSinglestepScheduler``;
- ``euler_maruyama`` (``vp_sde`` only): U-ViT's reverse-SDE sampler, no clipping.

The diffusers samplers run on the grid of ``T`` timesteps; under ``vp_sde`` index ``i`` is the
continuous time ``(i + 1) / T`` and its betas make ``abar_i = alpha((i + 1) / T)`` exactly.
Fewer steps than training timesteps use "trailing" spacing, so sampling starts at the last index.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from lightning_mods._generation.vp_sde import NETWORK_TIME_SCALE, VPSDE

NOISE_PROCESSES: tuple[str, ...] = ("discrete", "vp_sde")
SAMPLERS: tuple[str, ...] = ("ddpm", "ddim", "dpmsolver++", "dpmsolver++_singlestep", "euler_maruyama")
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


def check_sampler(sampler: str, num_steps: int, num_train_timesteps: int, noise_process: str = "discrete") -> None:
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}; got {sampler!r}")
    if sampler == "euler_maruyama":
        if noise_process != "vp_sde":
            raise ValueError("sampler: euler_maruyama integrates the continuous VP SDE; set noise_process: vp_sde "
                             "or pick one of ddpm, ddim, dpmsolver++, dpmsolver++_singlestep")
        if num_steps < 2:
            raise ValueError(f"num_sampling_steps for euler_maruyama must be >= 2, got {num_steps}")
        return
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


class DiscreteProcess:
    """DDPM's discrete process: times are the integer timesteps, fed to the network as they are."""

    name = "discrete"

    def __init__(self, config: dict) -> None:
        from diffusers import DDPMScheduler

        self.config = config  # the diffusers samplers' keyword arguments
        self.num_train_timesteps = config["num_train_timesteps"]
        self._scheduler = DDPMScheduler(**config)

    def draw_times(self, batch: int, generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
        return torch.randint(0, self.num_train_timesteps, (batch,), generator=generator,
                             device="cpu" if generator is not None else device).to(device)

    def grid_time(self, index: torch.Tensor) -> torch.Tensor:
        return index

    def network_time(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self._scheduler.add_noise(x0, noise, t)


class VPSDEProcess:
    """U-ViT's continuous VP SDE: ``t ~ U(0, 1)``, network input ``t * 999``."""

    name = "vp_sde"

    def __init__(self, num_train_timesteps: int, beta_start: float, beta_end: float) -> None:
        self.num_train_timesteps = num_train_timesteps
        self.sde = VPSDE(beta_start * num_train_timesteps, beta_end * num_train_timesteps)
        self.config = {"num_train_timesteps": num_train_timesteps, "prediction_type": "epsilon",
                       "trained_betas": self.sde.grid_betas(num_train_timesteps).tolist()}

    def draw_times(self, batch: int, generator: Optional[torch.Generator], device: torch.device) -> torch.Tensor:
        return torch.rand((batch,), generator=generator, device="cpu" if generator is not None else device).to(device)

    def grid_time(self, index: torch.Tensor) -> torch.Tensor:
        return (index.double() + 1.0) / self.num_train_timesteps

    def network_time(self, t: torch.Tensor) -> torch.Tensor:
        return t.float() * NETWORK_TIME_SCALE

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.sde.add_noise(x0, noise, t)


def make_noise_process(noise_process: str, num_train_timesteps: int = 1000, beta_schedule: str = "linear",
                       beta_start: float = 1e-4, beta_end: float = 0.02):
    """The ``discrete`` or ``vp_sde`` process of the given schedule (one-line ``ValueError`` otherwise)."""
    config = schedule_config(num_train_timesteps, beta_schedule, beta_start, beta_end)
    if noise_process == "discrete":
        return DiscreteProcess(config)
    if noise_process != "vp_sde":
        raise ValueError(f"noise_process must be one of {', '.join(NOISE_PROCESSES)}; got {noise_process!r}")
    if beta_schedule != "linear":
        raise ValueError(f"beta_schedule must be linear for noise_process vp_sde (beta(t) is linear in t), "
                         f"got {beta_schedule!r}")
    return VPSDEProcess(num_train_timesteps, beta_start, beta_end)


def make_sampler(name: str, config: dict, clip_sample: bool, clip_range: float = 1.0):
    """A fresh diffusers scheduler for one sampling run (they keep per-run state)."""
    from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, DPMSolverSinglestepScheduler

    if name == "ddpm":
        return DDPMScheduler(**config, variance_type="fixed_small", clip_sample=clip_sample,
                             clip_sample_range=clip_range, timestep_spacing="trailing")
    if name == "ddim":
        return DDIMScheduler(**config, clip_sample=clip_sample, clip_sample_range=clip_range,
                             set_alpha_to_one=True, timestep_spacing="trailing")
    if name == "dpmsolver++":
        return DPMSolverMultistepScheduler(**config, algorithm_type="dpmsolver++", solver_order=2,
                                           lower_order_final=True, timestep_spacing="trailing")
    if name == "dpmsolver++_singlestep":  # its timesteps start at the last index already
        return DPMSolverSinglestepScheduler(**config, algorithm_type="dpmsolver++", solver_order=3,
                                            lower_order_final=True)
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
