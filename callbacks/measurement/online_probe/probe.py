"""The :class:`OnlineLinearProbe` callback: a linear head on detached features, trained during
pre-training and measured at validation (the pieces it takes: :mod:`callbacks.measurement.online_probe`)."""
from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule, Trainer

from callbacks._utils.distributed import is_distributed, log_identical
from callbacks.cost import PER_STEP
from callbacks.measurement.shared_features import SharedEvaluation
from callbacks.settings_key import SettingsKeyed, check_name
from lightning_mods.evaluation import metric_names
from lightning_mods.evaluation._eval_mode import isolated_eval
from lightning_mods.evaluation._probe_head import ProbeHead
from lightning_mods.evaluation.over_depth import DepthRows, write_pending
from ._heads import OnlineProbeHeads
from ._probed_samples import ProbedQueue
from ._validation_scores import ValidationScores, shared_features, shared_validation
from .depth_heads import DepthHeads
from .linear_heads import LinearHeads
from .replay import Replay, is_whole_number

OWNER = "OnlineLinearProbe"


class OnlineLinearProbe(SettingsKeyed):
    """Train linear heads on detached features during pre-training.

    Every ``every_n_steps``-th training batch it embeds the batch's first ``max_samples`` images
    with ``pl_module.forward_features`` (eval mode, no grad, RNG states forked: the pre-training
    is the same run with and without it) and steps its heads on them. At validation it scores
    every validation sample once and logs ``online_probe/val_top1``; ``online_probe/train_loss``
    and ``online_probe/train_top1`` are epoch means over the fresh probed samples.
    ``every_n_steps=1, max_samples=None, replay=None`` is lightly's every-batch probe.

    Args:
        heads: the heads (:class:`~.linear_heads.LinearHeads`: classes, rate or rates, optimiser).
        every_n_steps: probe every n-th training batch; max_samples: of its first this many samples.
        replay: the last probed samples swept once per probe (:class:`~.replay.Replay`); ``None``:
            one step on the fresh samples alone.
        depth: also a head per chosen block (:class:`~.depth_heads.DepthHeads`), rows in ``eval_per_block.csv``.
        name: the tag of this instance's metric names when the Trainer has several.
    """
    cost = PER_STEP

    def __init__(self, heads: LinearHeads = LinearHeads(), every_n_steps: int = 4, max_samples: Optional[int] = 16,
                 replay: Optional[Replay] = Replay(), depth: Optional[DepthHeads] = None,
                 name: Optional[str] = None) -> None:
        super().__init__()
        if not is_whole_number(every_n_steps, 1):
            raise ValueError(f"{OWNER}: every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        if max_samples is not None and not is_whole_number(max_samples, 2):
            raise ValueError(f"{OWNER}: max_samples must be an integer >= 2 or None, got {max_samples!r}")
        self.heads, self.replay, self.depth = heads, replay, depth
        self.every_n_steps, self.max_samples, self.name = every_n_steps, max_samples, check_name(OWNER, name)
        self.sweep = replay.sweep(every_n_steps) if replay is not None else None
        self.num_classes, self.lrs = heads.num_classes, heads.lrs
        self.over_depth = DepthRows()  # per-block rows of fit's validations (in the state) and the last validate's
        self.probe_heads: Optional[OnlineProbeHeads] = None  # built once num_classes is known
        self._restored: Optional[dict[str, Any]] = None  # a state loaded before that
        self.queue = ProbedQueue()  # the probed samples on their way to the heads, and the epoch's sums
        self.batches = 0  # training batches seen (the cadence; in the state)
        self._device = torch.device("cpu")
        self._scores: Optional[ValidationScores] = None  # this validation epoch's

    @property
    def head(self) -> Optional[ProbeHead]:
        """The first rate's head on the final features (``None`` until their width is known);
        every head: :attr:`probe_heads`."""
        return self.probe_heads.heads[0] if self.probe_heads and self.probe_heads.heads else None

    @property
    def steps(self) -> int:  # probes the heads have stepped on
        return self.probe_heads.steps if self.probe_heads else int((self._restored or {}).get("steps", 0))

    def identity(self) -> dict[str, Any]:
        h, r = self.heads, self.replay
        optional = {"replay_samples": r and r.samples, "head_batch": r and r.head_batch,
                    "head_steps": r and r.head_steps, "blocks": self.depth and self.depth.blocks}
        return {"optimizer": h.optimizer, "lr": h.given, "momentum": float(h.momentum), "batch_norm": h.batch_norm,
                "seed": int(h.seed), "every_n_steps": self.every_n_steps, "max_samples": self.max_samples,
                **{k: v for k, v in optional.items() if v is not None}}

    def default_identity(self) -> dict[str, Any]:
        return OnlineLinearProbe().identity()

    def tag_exclusions(self) -> tuple[str, ...]:
        return ("lr",) if self.heads.several else ()

    def value_tags(self) -> list[str]:
        return self.heads.tags()

    def metric_names_of(self, name: str) -> list[str]:
        """The logged names of vocabulary ``name``, one per head."""
        return [self.metric(name, tag) for tag in self.value_tags()]

    def depth_rows(self, trainer: Trainer) -> list[dict[str, Any]]:
        return self.over_depth.rows(trainer)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.depth:
            self.depth.setup(pl_module)
        self._device = trainer.strategy.root_device
        SharedEvaluation.of(trainer).need("val_dataset", self.depth is not None)
        self.num_classes = self.num_classes or getattr(getattr(trainer, "datamodule", None), "num_classes", None)
        if not self.num_classes:
            raise ValueError(f"{OWNER}: heads.num_classes is not set and the datamodule has no num_classes")
        self._heads_object().to(self._device)
        if not self.head and getattr(pl_module, "num_features", None):
            self.build_heads(int(pl_module.num_features))

    def _heads_object(self) -> OnlineProbeHeads:
        if self.probe_heads is None:
            self.probe_heads = OnlineProbeHeads(int(self.num_classes), self.heads, self.sweep).to(self._device)
            if self._restored is not None:
                self.probe_heads.load_state_dict(self._restored)
                self._restored = None
        return self.probe_heads

    def build_heads(self, feature_dim: int) -> None:
        """The heads for features of width ``feature_dim`` (a restored state is applied to them)."""
        self._heads_object().build(int(feature_dim))

    def _features(self, trainer: Trainer, pl_module: LightningModule,
                  images: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The detached features (and the chosen blocks'), on the heads' device; heads built if needed."""
        with isolated_eval(pl_module), trainer.precision_plugin.forward_context():
            features, outputs = (self.depth.forward(pl_module, images) if self.depth
                                 else (pl_module.forward_features(images), []))
        return self._heads_object().inputs(features, outputs, self.depth)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        probe_now = self.batches % self.every_n_steps == 0
        self.batches += 1
        if not probe_now:
            return
        images, labels = batch[0][: self.max_samples], batch[1][: self.max_samples].to(self._device)
        if self.heads.batch_norm and len(labels) < 2:
            return  # batch norm cannot train on one sample (DistributedSampler: same size on every rank)
        features, blocks = self._features(trainer, pl_module, images)
        # with a replay, every rank replays every rank's samples: rank 0's checkpoint resumes every rank exactly
        self.queue.put(self._heads_object, features, labels, blocks, gather=self.sweep is not None and is_distributed())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.queue.flush(self._heads_object)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        means = self.queue.epoch_means(self._heads_object)  # the epoch's last probe counts in its means
        if means is not None:
            names = zip(self.metric_names_of(metric_names.ONLINE_PROBE_TRAIN_LOSS),
                        self.metric_names_of(metric_names.ONLINE_PROBE_TRAIN_TOP1))
            log_identical(pl_module, {n: v for pair, values in zip(names, means) for n, v in zip(pair, values)})

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.queue.flush(self._heads_object)  # the heads scored are those of every probe so far
        self._scores = ValidationScores(self._heads_object()) if self.num_classes else None

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking or dataloader_idx != 0 or self.steps == 0 or shared_validation(trainer):
            return
        features, blocks = self._features(trainer, pl_module, batch[0])
        self._scores.score_batch(trainer, features, batch[1].to(self._device), blocks)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self.steps:
            return
        if shared_validation(trainer):  # this rank's strided part of the shared pass
            collected = shared_features(trainer, pl_module, self.depth is not None)
            features, blocks = self._heads_object().inputs(collected.features, collected.blocks or [], self.depth)
            self._scores.score(features, collected.labels.to(self._device), blocks)
        blocks = self._scores.log(pl_module, self.metric_names_of(metric_names.ONLINE_PROBE_VAL_TOP1))
        if self.depth:
            self.depth.record(trainer, self.over_depth, blocks)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        write_pending(trainer)  # the per-block table and picture, once all contributors have added their rows

    def state_dict(self) -> dict[str, Any]:
        """The heads' state (:class:`~callbacks.measurement.online_probe._heads.OnlineProbeHeads`),
        the batches seen, the epoch's sums so far, the samples waiting and the per-block rows."""
        heads = self.probe_heads.state_dict() if self.probe_heads else dict(self._restored or {})
        return {**heads, **self.queue.state_dict(), "batches": self.batches,
                "depth_history": [dict(row) for row in self.over_depth.depth_history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.over_depth.depth_history = [dict(row) for row in state_dict.get("depth_history", [])]
        self.queue.load_state_dict(state_dict)
        self.batches = int(state_dict.get("batches", state_dict.get("steps", 0)))  # older: probed every batch
        heads = {k: v for k, v in state_dict.items() if k not in ("batches", "depth_history", *self.queue.KEYS)}
        if self.probe_heads is None:  # before setup: applied there
            self._restored = heads
        else:
            self.probe_heads.load_state_dict(heads)
