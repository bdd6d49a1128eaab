"""Heads over depth (a piece of the online probe).

``blocks: all`` (or a list of block indices, 1 = nearest the input, -1 = the last) also trains a
head, per rate, on every chosen block's pooled output, from the same forward pass as the final
features' head, each initialised as a probe of that block alone would be. Their validation
accuracies and the blocks' mean feature norms become rows of ``eval_per_block.csv`` and the
picture ``eval/over_depth`` (:mod:`lightning_mods.evaluation.over_depth`); the logged metrics
stay those of the final features' heads.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_mods.evaluation.feature_contract import features_and_blocks, require_blocks
from lightning_mods.evaluation.over_depth import BlockSpec, DepthRows, check_blocks, resolve_blocks


class DepthHeads:
    """Which blocks the probe's extra heads read, and their rows over depth.

    Args:
        blocks: ``"all"`` or a list of block indices (see module docstring).
        rows: the probe's :class:`DepthRows` (in its state; found by the table's writer).
    """

    def __init__(self, blocks: BlockSpec, rows: DepthRows, owner: str = "OnlineLinearProbe") -> None:
        self.blocks = check_blocks(owner, blocks)
        self.rows, self.owner = rows, owner

    def setup(self, pl_module: LightningModule) -> None:
        require_blocks(pl_module, f"{self.owner}: blocks")

    @staticmethod
    def forward(pl_module: LightningModule, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final features and every block's pooled output, one pass."""
        return features_and_blocks(pl_module, images)

    def choose(self, outputs: list[torch.Tensor], built: Iterable[int], device: torch.device) -> dict[int, torch.Tensor]:
        """The chosen blocks' outputs (``block -> N x D``, 1-based), as float on ``device``;
        ``built``: the blocks that already have heads (a restored probe's), else resolved here."""
        blocks = list(built) or resolve_blocks(self.owner, self.blocks, len(outputs))
        return {b: outputs[b - 1].float().to(device) for b in blocks}

    def record(self, trainer: Trainer, scores: Optional[dict[int, dict[str, Any]]]) -> None:
        """This validation's row per block (its accuracies and feature norm)."""
        if scores:
            self.rows.record(trainer, [{"epoch": int(trainer.current_epoch), "step": int(trainer.global_step),
                                        "block": block, **row} for block, row in scores.items()])
