"""Classifier-free guidance (Ho and Salimans 2022), as U-ViT trains and samples with it: labels
dropped to the null class while training, and the guided noise prediction while sampling."""
from __future__ import annotations

from typing import Optional

import torch


def drop_labels(labels: torch.Tensor, probability: float, null_class: int,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Replace each label by ``null_class`` with ``probability`` (classifier-free guidance training)."""
    if probability <= 0.0:
        return labels
    draw = torch.rand(labels.shape, generator=generator, device="cpu" if generator is not None else labels.device)
    return torch.where(draw.to(labels.device) < probability, torch.full_like(labels, null_class), labels)


def guided_noise(eps_cond: torch.Tensor, eps_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance: ``eps_u + s (eps_c - eps_u)``."""
    return eps_uncond + guidance_scale * (eps_cond - eps_uncond)
