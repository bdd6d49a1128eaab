"""Heads over depth (a piece of the online probe).

``depth: {blocks: all}`` (or a list of block indices, 1 = nearest the input, -1 = the last) also
trains a head, per rate, on every chosen block's pooled output, from the same forward pass as the
final features' head, each initialised as a probe of that block alone would be. Their validation
accuracies and the blocks' mean feature norms become rows of ``eval_per_block.csv`` and the
picture ``eval/over_depth`` (:mod:`lightning_mods.evaluation.over_depth`); the logged metrics
stay those of the final features' heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_mods.evaluation.feature_contract import features_and_blocks, require_blocks
from lightning_mods.evaluation.over_depth import DepthRows, check_blocks, resolve_blocks

OWNER = "OnlineLinearProbe"


@dataclass(frozen=True)
class DepthHeads:
    """Which blocks the probe's extra heads read.

    Args:
        blocks: ``"all"`` or a list of block indices (see the module docstring).
    """

    blocks: Union[str, list[int]] = "all"

    def __post_init__(self) -> None:
        if self.blocks is None:
            raise ValueError(f"{OWNER}: depth.blocks must be 'all' or a list of block indices, got None "
                             "(no heads over depth: depth null)")
        object.__setattr__(self, "blocks", check_blocks(OWNER, self.blocks))

    @staticmethod
    def setup(pl_module: LightningModule) -> None:
        require_blocks(pl_module, f"{OWNER}: depth")

    @staticmethod
    def forward(pl_module: LightningModule, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final features and every block's pooled output, one pass."""
        return features_and_blocks(pl_module, images)

    def choose(self, outputs: list[torch.Tensor], built: Iterable[int], device: torch.device) -> dict[int, torch.Tensor]:
        """The chosen blocks' outputs (``block -> N x D``, 1-based), as float on ``device``;
        ``built``: the blocks that already have heads (a restored probe's), else resolved here."""
        blocks = list(built) or resolve_blocks(OWNER, self.blocks, len(outputs))
        return {b: outputs[b - 1].float().to(device) for b in blocks}

    @staticmethod
    def record(trainer: Trainer, rows: DepthRows, scores: Optional[dict[int, dict[str, Any]]]) -> None:
        """This validation's row per block (its accuracies and feature norm) into ``rows``."""
        if scores:
            rows.record(trainer, [{"epoch": int(trainer.current_epoch), "step": int(trainer.global_step),
                                   "block": block, **row} for block, row in scores.items()])
