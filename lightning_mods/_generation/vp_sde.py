"""U-ViT's continuous-time VP SDE and its Euler-Maruyama sampler (Bao et al. 2023, the CIFAR-10
runs; Song et al. 2021, "Score-Based Generative Modeling through SDEs", the VP SDE).

Forward process on ``t in [0, 1]``: ``dx = -1/2 beta(t) x dt + sqrt(beta(t)) dw`` with the linear
``beta(t) = beta_min + t (beta_max - beta_min)`` (U-ViT: 0.1 to 20), so

    x_t | x_0 ~ N(sqrt(alpha(t)) x_0, (1 - alpha(t)) I),  alpha(t) = exp(-int_0^t beta).

Training draws ``t ~ U(0, 1)`` (no lower cut-off) and feeds the network ``t * 999``. The
reverse SDE ``dx = [-1/2 beta x - beta score] dt + sqrt(beta) dw`` with
``score = -eps / sqrt(1 - alpha(t))`` is integrated by Euler-Maruyama over the times
``1 = t_N > ... > t_1 = eps`` (``linspace(eps, 1, N)``) and a last noise-free step to 0, no
clipping. diffusers' ``ScoreSdeVpScheduler`` is deprecated and steps by ``1 / N`` whatever the
grid, which equals this only for ``N = 1 / eps``; hence the few lines here.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

NETWORK_TIME_SCALE = 999.0  # U-ViT's ScoreModel.predict: nnet(x_t, t * 999)
SAMPLING_EPS = 1e-3  # U-ViT's euler_maruyama default


class VPSDE:
    """The linear VP SDE of U-ViT's ``sde.VPSDE`` (float64 coefficients, cast at use)."""

    def __init__(self, beta_min: float = 0.1, beta_max: float = 20.0) -> None:
        if not 0.0 < beta_min < beta_max:
            raise ValueError(f"beta_min and beta_max must satisfy 0 < beta_min < beta_max, got {beta_min}, {beta_max}")
        self.beta_min, self.beta_max = float(beta_min), float(beta_max)

    def beta(self, t: torch.Tensor) -> torch.Tensor:
        return self.beta_min + t * (self.beta_max - self.beta_min)

    def beta_integral(self, t: torch.Tensor) -> torch.Tensor:
        """``int_0^t beta``."""
        return self.beta_min * t + 0.5 * (self.beta_max - self.beta_min) * t ** 2

    def marginal(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sqrt(alpha(t)), sqrt(1 - alpha(t)))``, the mean coefficient and std of ``x_t | x_0``."""
        integral = self.beta_integral(t.double())
        return torch.exp(-0.5 * integral), torch.sqrt(-torch.expm1(-integral))

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``sqrt(alpha(t)) x_0 + sqrt(1 - alpha(t)) noise`` for per-sample times ``t``."""
        mean, std = self.marginal(t)
        shape = (-1,) + (1,) * (x0.dim() - 1)
        return (mean.view(shape).to(x0.dtype) * x0 + std.view(shape).to(x0.dtype) * noise)

    def grid_betas(self, num_steps: int) -> np.ndarray:
        """Discrete betas whose ``prod_{j <= i} (1 - beta_j)`` is ``alpha((i + 1) / num_steps)`` exactly,
        for diffusers' samplers on the grid ``t_i = (i + 1) / num_steps``."""
        integral = self.beta_integral(np.arange(0, num_steps + 1, dtype=np.float64) / num_steps)
        return -np.expm1(-np.diff(integral))


def euler_maruyama(predict_noise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], sde: VPSDE,
                   noise: torch.Tensor, num_steps: int, generator: Optional[torch.Generator] = None,
                   eps: float = SAMPLING_EPS) -> torch.Tensor:
    """Reverse-SDE samples from ``noise`` (``x_1``) in ``num_steps`` steps.

    ``predict_noise(x_t, t)`` gets the continuous time ``t`` (a scalar tensor). Step noise is drawn
    from ``generator`` (on the CPU) in step order; the last step, to ``t = 0``, adds none.
    """
    if num_steps < 2:
        raise ValueError(f"num_sampling_steps for euler_maruyama must be >= 2, got {num_steps}")
    times = torch.tensor(np.append(0.0, np.linspace(eps, 1.0, num_steps)), dtype=torch.float64)
    x = noise.float()
    for s, t in reversed(list(zip(times[:-1], times[1:]))):
        beta = sde.beta(t)
        std = sde.marginal(t)[1]
        eps_pred = predict_noise(x, t.float()).float()
        score = -eps_pred / std.float()
        drift = -0.5 * beta.float() * x - beta.float() * score
        dt = (s - t).float()  # negative
        x = x + drift * dt
        if s > 0:
            z = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
            x = x + torch.sqrt(beta * (t - s)).float() * z
    return x
