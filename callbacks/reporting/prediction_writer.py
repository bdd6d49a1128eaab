"""What ``shortcutlab predict`` writes: every module's ``predict_step`` outputs, in dataset order.

Each ``predict_step`` returns a dict of per-sample tensors (``embeddings`` from
``forward_features``, ``labels``, and ``logits`` for classifiers and probes).
:class:`PredictionWriter` concatenates them over the epoch and saves one file that loads with

    predictions = torch.load("predictions.pt", weights_only=True)  # {"embeddings": N x D, ...}

plus ``indices`` (the sample's position in the predict dataset), and draws the embeddings in two
dimensions, coloured by label (``embedding_map.png`` beside it, :mod:`lightning_mods.pictures._embedding_map`:
scikit-learn's t-SNE, seeded, subsampled above ``max_points``). Under DDP every rank writes
its part next to the output file (a folder every node sees, as the log directory is), rank 0
merges the parts in dataset order, drops the samples a ``DistributedSampler`` repeated to even
out the ranks, and removes the parts.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info

from lightning_mods.pictures._embedding_map import EMBEDDING_MAP_POINTS, write_embedding_map
from lightning_mods.checkpointing.checkpoint_io import save_torch_atomically
from lightning_mods.run_outputs.run_folder import shared_run_dir
from callbacks.cost import ONCE


def concatenate_predictions(batches: Sequence[dict[str, torch.Tensor]],
                            batch_indices: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
    """Per-batch dicts of tensors -> one dict of tensors along dim 0, with their ``indices``."""
    if not batches:
        return {"indices": torch.empty(0, dtype=torch.long)}
    keys = list(batches[0])
    for batch in batches:
        if not isinstance(batch, dict) or list(batch) != keys:
            raise TypeError(f"PredictionWriter: every predict_step must return a dict with keys {keys}; "
                            f"got {type(batch).__name__} {list(batch) if isinstance(batch, dict) else ''}")
    merged = {key: torch.cat([batch[key].detach().cpu() for batch in batches]) for key in keys}
    flat = [i for indices in batch_indices for i in indices]
    # no indices (not a DataLoader): one process reads its samples in order
    n = len(merged[keys[0]])
    merged["indices"] = torch.as_tensor(flat, dtype=torch.long) if len(flat) == n else torch.arange(n)
    return merged


def merge_in_dataset_order(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Parts of the dataset (one per rank) -> one dict sorted by ``indices``, each sample once."""
    whole = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
    order = torch.argsort(whole["indices"], stable=True)
    indices = whole["indices"][order]
    first = torch.ones_like(indices, dtype=torch.bool)
    first[1:] = indices[1:] != indices[:-1]  # DistributedSampler pads by repeating samples
    keep = order[first]
    return {key: value[keep] for key, value in whole.items()}


class PredictionWriter(BasePredictionWriter):
    """Saves the predict epoch's outputs to ``path`` (default ``<run folder>/predictions.pt``).

    Args:
        path: output file (``.pt``, a dict of tensors for ``torch.load(..., weights_only=True)``);
            None writes ``predictions.pt`` in the trainer's log directory.
        embedding_map: also draw ``embedding_map.png`` next to it (when there are labels).
        max_points: the map shows a seeded random subset of this many samples above it.
        seed: of the subset and of t-SNE.
    """
    cost = ONCE

    def __init__(self, path: Optional[str] = None, embedding_map: bool = True,
                 max_points: int = EMBEDDING_MAP_POINTS, seed: int = 0) -> None:
        super().__init__(write_interval="epoch")
        if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 3:
            raise ValueError(f"PredictionWriter: max_points must be an integer >= 3, got {max_points!r}")
        self.path = path
        self.embedding_map = embedding_map
        self.max_points = max_points
        self.seed = seed
        self.written: Optional[Path] = None
        self.map_written: Optional[Path] = None

    def output_path(self, trainer: Trainer) -> Path:
        return Path(self.path) if self.path is not None else shared_run_dir(trainer) / "predictions.pt"

    def write_on_epoch_end(self, trainer: Trainer, pl_module: LightningModule, predictions: Sequence[Any],
                           batch_indices: Sequence[Any]) -> None:
        if len(batch_indices) > 1:
            raise ValueError(f"PredictionWriter: predict with one dataloader (got {len(batch_indices)})")
        path = self.output_path(trainer)  # the run folder is broadcast: every rank asks
        indices = batch_indices[0] if batch_indices else []
        part = concatenate_predictions(predictions, indices)
        if trainer.world_size == 1:
            self.save(merge_in_dataset_order([part]), path)
            self.draw_map(trainer)
            return
        if not indices:
            raise ValueError("PredictionWriter: under DDP the predict loader must be a DataLoader (Lightning "
                             "then reports each sample's index, needed to merge the ranks)")
        part_path = path.with_name(f"{path.stem}.rank{trainer.global_rank}{path.suffix}")
        part_path.parent.mkdir(parents=True, exist_ok=True)
        save_torch_atomically(part, part_path)
        trainer.strategy.barrier("prediction_writer_parts")
        if trainer.is_global_zero:
            part_paths = [path.with_name(f"{path.stem}.rank{r}{path.suffix}") for r in range(trainer.world_size)]
            self.save(merge_in_dataset_order([torch.load(p, weights_only=True) for p in part_paths]), path)
            for p in part_paths:
                os.remove(p)
            self.draw_map(trainer)
        trainer.strategy.barrier("prediction_writer_merged")

    def draw_map(self, trainer: Trainer) -> None:
        """``embedding_map.png`` next to the written predictions (rank 0)."""
        if not self.embedding_map or self.written is None:
            return
        predictions = torch.load(self.written, weights_only=True)
        if "embeddings" not in predictions or "labels" not in predictions or len(predictions["labels"]) < 3:
            return
        names = getattr(getattr(trainer, "datamodule", None), "class_names", None)
        self.map_written = write_embedding_map(predictions["embeddings"], predictions["labels"],
                                               self.written.with_name("embedding_map.png"), names,
                                               self.max_points, self.seed,
                                               f"{type(trainer.lightning_module).__name__} embeddings "
                                               f"({self.written.name})")
        rank_zero_info(f"PredictionWriter: drew the embedding map {self.map_written}")

    def save(self, predictions: dict[str, torch.Tensor], path: Path) -> None:
        save_torch_atomically(predictions, path)
        self.written = path
        shapes = ", ".join(f"{key} {tuple(value.shape)}" for key, value in predictions.items())
        rank_zero_info(f"PredictionWriter: wrote {len(predictions['indices'])} samples to {path} ({shapes})")
