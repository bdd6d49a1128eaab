"""A measurement callback of one's own: how much each residual block's branches add to what
flows through it, ``mean ||f_k(x)|| / mean ||block output||`` per block, at every validation
(``docs``: extending shortcutlab, "A measurement callback").

It reads the network only through public hooks: ``residual_blocks`` finds the residual blocks of
any family, each block's ``branch_hook`` sees every branch output (sub-layer ``j``, before its
weight ``b_j``), and the module's ``forward_intermediates`` runs the evaluation pass. With this
file's folder on ``PYTHONPATH``::

    shortcutlab fit --config configs/digits_mae.yaml --trainer.callbacks+=branch_norm_ratio.BranchNormRatio
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_mods.backbone import residual_blocks


@torch.no_grad()
def branch_to_output_ratios(module: LightningModule, images: torch.Tensor) -> list[torch.Tensor]:
    """Per residual block that the evaluation pass runs, in depth order: the mean per-sample L2
    norm of its branch outputs (over its sub-layers) divided by the mean norm of its output."""
    branch_norms: dict[int, list[torch.Tensor]] = {}
    output_norms: dict[int, torch.Tensor] = {}
    blocks = residual_blocks(module)
    previous = [block.branch_hook for block in blocks]  # another callback's hook (ResidualDroppath) still runs
    handles = []
    for i, block in enumerate(blocks):
        def record_branch(block: Any, j: int, branch: torch.Tensor, i: int = i) -> torch.Tensor:
            if previous[i] is not None:
                branch = previous[i](block, j, branch)
            branch_norms.setdefault(i, []).append(branch.flatten(1).norm(dim=1).mean())
            return branch  # unchanged: a measurement only

        def record_output(_module: Any, _inputs: Any, output: torch.Tensor, i: int = i) -> None:
            output_norms[i] = output.flatten(1).norm(dim=1).mean()

        block.branch_hook = record_branch
        handles.append(block.register_forward_hook(record_output))
    try:
        module.forward_intermediates(images, intermediates_only=True)
    finally:
        for block, handle, hook in zip(blocks, handles, previous):
            block.branch_hook = hook
            handle.remove()
    return [torch.stack(branch_norms[i]).mean() / output_norms[i] for i in sorted(output_norms)]


class BranchNormRatio(Callback):
    """Logs ``branch_ratio/block<i>`` (1-based) on the first ``max_samples`` validation images."""

    def __init__(self, max_samples: int = 64) -> None:
        super().__init__()
        self.max_samples = max_samples

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx != 0 or dataloader_idx != 0 or trainer.sanity_checking:
            return
        ratios = branch_to_output_ratios(pl_module, batch[0][: self.max_samples])
        for i, ratio in enumerate(ratios, start=1):
            pl_module.log(f"branch_ratio/block{i}", ratio, on_epoch=True, sync_dist=True, batch_size=1)
