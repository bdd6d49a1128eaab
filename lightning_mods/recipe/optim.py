"""Optimiser recipe shared by the LightningModules (the decay paper's MAE recipe).

- no weight decay on norms, biases, position embeddings, tokens and shortcut alphas;
- peak learning rate = base lr x global batch / 256, where the global batch is
  per-device batch x devices x nodes x gradient accumulation;
- per-step linear warm-up from 0, then cosine to ``min_lr_ratio * peak``;
- AdamW runs torch's fused kernel wherever torch has one for the parameters' device and dtype
  (:func:`adamw`), else the ``foreach`` one.

Step counting: ``LambdaLR`` applies ``multiplier(0)`` to the first optimiser step and Lightning
steps it after every optimiser step, so step ``s`` runs at ``multiplier(s)``. The warm-up is
``s / warmup_steps`` as in U-ViT's ``customized_lr_scheduler`` and MAE's per-iteration
``adjust_learning_rate`` (both start at 0 and reach the peak at ``s = warmup_steps``).
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
from timm.optim import param_groups_weight_decay as timm_param_groups_weight_decay
from torch import nn

NO_DECAY_NAME_PARTS = ("pos_embed", "cls_token", "mask_token", "time_token", "label_emb", "dist_token",
                       "reg_token", "alpha")


def no_decay_names(module: nn.Module, no_decay_name_parts: Iterable[str] = NO_DECAY_NAME_PARTS) -> list[str]:
    """Names of the parameters kept from decay by name: the last name part contains one of
    ``no_decay_name_parts`` (``encoder.pos_embed``, ``blocks.0.alpha_attn``) or the full name
    starts with one (``label_emb.weight``)."""
    parts = tuple(no_decay_name_parts)
    return [name for name, _ in module.named_parameters()
            if any(part in name.rsplit(".", 1)[-1] or name.startswith(part) for part in parts)]


def param_groups_weight_decay(
    module: nn.Module, weight_decay: float, no_decay_name_parts: Iterable[str] = NO_DECAY_NAME_PARTS
) -> list[dict]:
    """timm's ``param_groups_weight_decay``: no decay on 1-D parameters (norms, biases) and on the
    parameters :func:`no_decay_names` picks; frozen parameters left out.

    Returned decay group first, then the no-decay group (timm lists them the other way round):
    the optimiser state in checkpoints written before timm did this is stored in that order.
    """
    # timm matches no_weight_decay_list with fnmatch; our names hold no wildcard characters
    groups = timm_param_groups_weight_decay(module, weight_decay,
                                            no_weight_decay_list=no_decay_names(module, no_decay_name_parts))
    return sorted(groups, key=lambda group: group["weight_decay"] == 0.0)


def fused_kernel_available(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch has fused optimiser kernels for every parameter's device and dtype
    (CUDA, CPU, ... and floating point, per torch's own list)."""
    from lightning_mods._compat.library_private import fused_kernel_devices

    devices = fused_kernel_devices()
    params = list(params)
    return bool(params) and all(p.device.type in devices and torch.is_floating_point(p) for p in params)


class _AdamW(torch.optim.AdamW):
    """torch's AdamW, less the CUDA-graph capture check of each step while no CUDA or XPU context
    exists (none can then be capturing; the check would find nothing). Private: LightningCLI
    resolves ``--optimizer AdamW`` by class name among the subclasses it can import, and a public
    second ``AdamW`` would make that name ambiguous.

    Importing Lightning sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, so that check's
    ``torch.cuda.is_available()`` asks NVML at every step, and on a CUDA build of torch without a
    GPU nothing caches the answer: about 0.25 ms per step on the 2-core reference machine, a
    quarter of an online-probe head step. With a context the check runs as in torch."""

    def _accelerator_graph_capture_health_check(self) -> None:
        xpu = getattr(torch, "xpu", None)
        if torch.cuda.is_initialized() or (xpu is not None and xpu.is_initialized()):
            super()._accelerator_graph_capture_health_check()


def adamw(params: list[dict] | Iterable[torch.Tensor], **kwargs) -> torch.optim.AdamW:
    """torch's AdamW (:class:`_AdamW`) ``(params, **kwargs)`` with ``fused=True`` where
    :func:`fused_kernel_available` (one kernel for every parameter's update: 0.3x the ``foreach``
    step's time for a ViT-S on a 2-core CPU, ``benchmarks``), else torch's default (``foreach``
    on CUDA, a loop elsewhere).
    Results equal ``foreach`` within float32 rounding, not bit for bit. A checkpoint's optimiser
    state keeps the setting it was written with (``load_state_dict`` restores the groups' flags)."""
    params = list(params)
    tensors = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
    if "fused" not in kwargs and "foreach" not in kwargs and fused_kernel_available(tensors):
        kwargs["fused"] = True
    return _AdamW(params, **kwargs)


def per_device_batch_size(trainer) -> int:  # noqa: ANN001 (Trainer)
    """The train batch of one device: the datamodule's ``batch_size``, else the train loader's."""
    dm = getattr(trainer, "datamodule", None)
    if dm is not None and getattr(dm, "batch_size", None) is not None:
        return int(dm.batch_size)
    return int(trainer.train_dataloader.batch_size)


def global_batch_size(trainer, per_device_batch: int | None = None) -> int:  # noqa: ANN001 (Trainer)
    """per-device batch x devices x nodes x gradient accumulation."""
    if per_device_batch is None:
        per_device_batch = per_device_batch_size(trainer)
    return int(per_device_batch) * int(trainer.world_size) * int(trainer.accumulate_grad_batches)


def scaled_lr(base_lr: float, global_batch: int, reference_batch: int = 256) -> float:
    """The linear scaling rule: ``base_lr * global_batch / reference_batch``."""
    return base_lr * global_batch / reference_batch


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """LR multiplier at optimiser step ``step`` (0 = the first): ``step / warmup_steps`` during the
    warm-up, then cosine from 1 at ``warmup_steps`` to ``min_lr_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> dict:
    """A per-step ``LambdaLR`` in Lightning's ``lr_scheduler`` config form."""
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, warmup_steps, total_steps, min_lr_ratio))
    return {"scheduler": sched, "interval": "step", "frequency": 1}


def steps_from_epochs(trainer, epochs: float) -> int:  # noqa: ANN001 (Trainer)
    """Optimiser steps in ``epochs`` epochs of this trainer's training loader."""
    total = int(trainer.estimated_stepping_batches)
    max_epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
    if max_epochs is None:
        return int(epochs)
    return int(round(total * float(epochs) / max_epochs))


def lars(params: Iterable[torch.nn.Parameter], lr: float, momentum: float = 0.9,
         trust_coefficient: float = 0.001) -> torch.optim.Optimizer:
    """MAE's LARS for the ImageNet-1K linear probe (``util/lars.py`` of facebookresearch/mae):
    SGD with momentum whose step of each weight matrix (``ndim > 1``) is scaled by
    ``trust_coefficient * |w| / |g|``; biases and norms take plain momentum steps; no weight
    decay. timm's ``Lars`` with the trust ratio on the weights only (``always_adapt`` per group)
    and ``eps=0`` computes exactly that (``tests/lightning_mods/test_optim.py`` checks it against
    a float64 reference)."""
    from timm.optim import Lars

    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1], "always_adapt": True},
              {"params": [p for p in params if p.ndim <= 1], "always_adapt": False}]
    return Lars([g for g in groups if g["params"]], lr=lr, momentum=momentum, weight_decay=0.0,
                trust_coeff=trust_coefficient, eps=0.0)
