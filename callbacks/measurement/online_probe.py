"""Online linear probe: a linear classifier trained during pre-training on detached features
(callbacks; the MAE linear probe's head of the decay paper, section 4, trained online as in lightly's
``OnlineLinearClassifier``).

Every ``every_n_steps``-th training batch the callback embeds the first ``max_samples`` images of
the batch (augmented, full, unmasked) with an EXTRA forward pass ``pl_module.forward_features``,
in eval mode, under ``torch.no_grad`` and with forked RNG states, adds those features to a
replay of the last ``replay_samples`` probed samples (:mod:`callbacks._utils.feature_replay`) and takes
``every_n_steps`` optimiser steps of its own head (BatchNorm without affine, as MAE's linear
probe, then Linear) on batches of ``replay_samples // every_n_steps`` replayed samples, newest
first: one head step per training batch, on as many samples as the every-batch probe's.
Nothing the pre-training sees changes: not the module's gradients, weights, batch-norm
statistics or train/eval modes, nor the global RNG streams that draw the MAE masks and the data
order, so the pre-training is the same run with and without the callback.

Cost and accuracy: the extra forward runs over ALL tokens while an MAE training step encodes a
quarter of them, so embedding every full batch costs about half a training step (+50-57 % on a
quickstart epoch, measured side by side). The defaults (every 4th batch, its first 16 of 128
images: 4 images per training step) embed 1/32 of that, and the head steps are written by hand
(no autograd graph; see :meth:`OnlineLinearProbe._step`). After the quickstart's 100 epochs the
shipped probe reads 56.4 % validation top-1, the every-batch probe 57.5 % at the same rate
(2e-2), 54.7 % at the earlier default 1e-2 and 58.9 % at 3e-2 (``python -m benchmarks --only
probe-accuracy``, torch 2.14.1). Fewer images per step fall off a cliff: 14 images every 4th
batch gave 51.9-53.6 %, 12 gave 49.2-51.9 %, probing 32 images every 8th batch 49-53 %, at the
rates 2e-2 to 4e-2 (one 100-epoch run each; docs/performance.md). Without the replay
(``replay_samples=None``: one head step on each fresh handful) the earlier 32-image probe ended
at 47.5 % against 54.4 % with it (both at 1e-2). ``every_n_steps=1, max_samples=None,
replay_samples=None`` is lightly's every-batch probe. The training loss and accuracy, over the
fresh samples before the head steps on them, are summed on the device and logged once per
epoch; the validation accuracy reads the validation features kNN and effective rank read
(:mod:`callbacks.measurement.shared_features`) when the datamodule has a ``val_dataset``, else it embeds
the validation loop's batches itself.

No host read per probe: a probe whose features are non-finite on any rank (a diverged backbone)
must not step the heads, and that check's flag is copied to the host asynchronously; the heads
step on a probe's samples when the next probe comes (or the epoch ends, a validation starts,
training ends), by which time the flag is there. They step on the same samples in the same
order as if each probe had stepped at once; a checkpoint taken in between holds the waiting
samples, so a resumed run goes on exactly.

Under DDP the head is not part of the DDP-wrapped module: its gradients are averaged over
ranks before each step, and its batch-norm running statistics after it, so every rank holds
the same head (every rank probes the same batches: the cadence counts training batches, the
same number on every rank); the replay holds every rank's probed samples (one all_gather per
probe), the same on every rank, so rank 0's checkpoint resumes every rank exactly. Validation
accuracy counts every validation sample once (each rank scores its strided shard of the shared
features; on the validation loop's batches the duplicates a DistributedSampler pads with are
masked out) in a torchmetrics ``MulticlassAccuracy`` (micro), whose ``compute`` sums the counts
over ranks.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics.classification import MulticlassAccuracy

from lightning_mods.evaluation import metric_names
from lightning_mods.training.classification_steps import top_k_accuracy
from callbacks._utils.distributed import (all_gather_rows, all_reduce_sum, average_across_ranks_, distributed_padding_mask,
                          is_distributed, log_identical)
from lightning_mods.evaluation.eval_mode import isolated_eval
from lightning_mods.training.optim import adamw
from lightning_mods.evaluation.probe_head import ProbeHead, cross_entropy_slope_
from lightning_mods.evaluation.feature_contract import features_and_blocks, require_blocks
from lightning_mods.evaluation.over_depth import DepthRows, check_blocks, resolve_blocks, write_pending
from callbacks.settings_key import SettingsKeyed, check_name, format_setting
from callbacks._utils.feature_collection import loader_settings
from callbacks._utils.feature_replay import FeatureReplay
from callbacks._utils.probe_heads_together import JointStep, step_heads_together
from callbacks.measurement import shared_features as shared
from callbacks.measurement.shared_features import shared_features

DEFAULT_LR = {"adamw": 2e-2, "sgd": 0.1}


class OnlineLinearProbe(SettingsKeyed):
    """Train a linear probe on detached features during pre-training (see module docstring).

    Every ``every_n_steps`` training batches (micro-batches under gradient accumulation) the
    callback embeds the first ``max_samples`` samples of the batch and takes ``every_n_steps``
    optimiser steps on the replayed features (one, on those samples, with
    ``replay_samples=None``). Logs
    ``online_probe/train_loss`` and ``online_probe/train_top1`` as epoch means over the probed
    batches (this rank's samples) and ``online_probe/val_top1`` after validation epochs (all validation
    samples, the same on every rank; skipped in the sanity check and while the head is
    untrained, e.g. in ``validate``, where Lightning does not restore callback states).

    ``lr`` may be a list (MAE's linear probing sweeps the rate): one head per rate, each
    initialised from ``seed`` as a single-rate probe would be, all trained on the same detached
    features of one extra forward pass, each logged as ``online_probe/val_top1@lr=0.01``, ...
    With another ``OnlineLinearProbe`` in the same Trainer the names carry this one's settings
    too (``name`` sets that tag), see :mod:`callbacks.settings_key`.

    Args:
        num_classes: classes of the labels (default: the datamodule's ``num_classes``).
        feature_dim: width of ``forward_features`` (default: the module's ``num_features``,
            else found from the first batch).
        optimizer: ``"adamw"`` or ``"sgd"`` (momentum); weight decay 0 either way.
        lr: learning rate (default 2e-2 for AdamW, 0.1 for SGD), or a list of them.
        momentum: SGD momentum.
        batch_norm: BatchNorm1d without affine before the linear layer (MAE's linear probe).
        seed: seed of the head's initialisation (same head on every rank, no global RNG draw).
        every_n_steps: probe every n-th training batch (1: every batch).
        max_samples: probe at most this many samples of a batch (``None``: all of it); the
            loader shuffles, so the first ones are a random sample.
        replay_samples: keep the features of the last this many probed samples and sweep them
            once per probe, ``every_n_steps`` head steps of ``replay_samples // every_n_steps``
            samples (:mod:`callbacks._utils.feature_replay`; in the state, for exact resumes);
            ``None``: one head step on the fresh samples alone.
        name: the tag of this instance's metric names when the Trainer has several (default:
            its settings that differ from the defaults).
        blocks: also train a head (per rate) on every chosen block's pooled output (``"all"`` or a
            list of indices, 1 = nearest the input, -1 = the last), from the same forward pass, each
            initialised from ``seed`` as a probe of that block alone would be; their validation
            accuracies and the blocks' feature norms go to ``eval_per_block.csv`` and the picture
            ``eval/over_depth`` (:mod:`lightning_mods.evaluation.over_depth`); the logged metrics stay those of the
            ``forward_features`` heads.
    """

    def __init__(self, num_classes: Optional[int] = None, feature_dim: Optional[int] = None,
                 optimizer: Literal["adamw", "sgd"] = "adamw", lr: Union[float, list[float], None] = None,
                 momentum: float = 0.9, batch_norm: bool = True, seed: int = 0, every_n_steps: int = 4,
                 max_samples: Optional[int] = 16, replay_samples: Optional[int] = 512, name: Optional[str] = None,
                 blocks: Union[None, str, list[int]] = None) -> None:
        super().__init__()
        self.blocks = check_blocks("OnlineLinearProbe", blocks)
        if num_classes is not None and num_classes < 2:
            raise ValueError(f"OnlineLinearProbe: num_classes must be >= 2 or None, got {num_classes!r}")
        if feature_dim is not None and feature_dim < 1:
            raise ValueError(f"OnlineLinearProbe: feature_dim must be >= 1 or None, got {feature_dim!r}")
        if optimizer not in DEFAULT_LR:
            raise ValueError(f"OnlineLinearProbe: optimizer must be one of {tuple(DEFAULT_LR)}, got {optimizer!r}")
        rates = list(lr) if isinstance(lr, (list, tuple)) else [lr]
        if not rates or (isinstance(lr, (list, tuple)) and None in rates) or any(
                r is not None and (isinstance(r, bool) or not r > 0) for r in rates):
            raise ValueError(f"OnlineLinearProbe: lr must be > 0, a non-empty list of rates > 0, or None, got {lr!r}")
        if len(set(rates)) != len(rates):
            raise ValueError(f"OnlineLinearProbe: lr lists a rate twice: {lr!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"OnlineLinearProbe: momentum must be in [0, 1), got {momentum!r}")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"OnlineLinearProbe: every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        if max_samples is not None and (isinstance(max_samples, bool) or not isinstance(max_samples, int)
                                        or max_samples < 2):
            raise ValueError(f"OnlineLinearProbe: max_samples must be an integer >= 2 or None, got {max_samples!r}")
        if replay_samples is not None and (isinstance(replay_samples, bool) or not isinstance(replay_samples, int)
                                           or replay_samples // every_n_steps < 2):
            raise ValueError(f"OnlineLinearProbe: replay_samples must be None or an integer with at least 2 samples "
                             f"per head step (replay_samples // every_n_steps >= 2), got {replay_samples!r}")
        self.num_classes = num_classes
        self.feature_dim = feature_dim
        self.optimizer_name = optimizer
        self.given_lr = [float(r) for r in rates] if isinstance(lr, (list, tuple)) else lr
        self.lrs = [float(r) if r is not None else DEFAULT_LR[optimizer] for r in rates]
        self.lr = self.lrs[0]
        self.momentum = float(momentum)
        self.batch_norm = batch_norm
        self.seed = int(seed)
        self.every_n_steps = every_n_steps
        self.max_samples = max_samples
        self.replay_samples = replay_samples
        self.name = check_name("OnlineLinearProbe", name)
        self.heads: list[ProbeHead] = []  # one per rate of self.lrs
        self.optimizers: list[torch.optim.Optimizer] = []
        self.block_heads: dict[int, list[ProbeHead]] = {}  # per chosen block (1-based), one per rate
        self.block_optimizers: dict[int, list[torch.optim.Optimizer]] = {}
        # per rate and feature width: the blocks whose heads step together, and their JointStep
        self._block_groups: list[tuple[int, list[int], JointStep]] = []
        self.replay: Optional[FeatureReplay] = None  # the features' replay (with replay_samples)
        self.block_replay: dict[int, FeatureReplay] = {}  # per chosen block
        self.over_depth = DepthRows()  # per-block rows of fit's validations (in the state) and the last validate's
        self._pending_blocks: Optional[dict[int, list[dict[str, Any]]]] = None  # restored before they are built
        self.steps = 0  # optimiser steps of the heads (they step together)
        self._epoch_sums: Optional[torch.Tensor] = None  # this epoch's per-head (loss x n, correct, n) sums
        self._probed: Optional[Probed] = None  # the last probe's samples, until its check reaches the host
        self.batches = 0  # training batches seen (the cadence; in the state_dict for resumes)
        self._device = torch.device("cpu")
        self._pending_state: Optional[dict[str, Any]] = None
        self._val_top1: list[MulticlassAccuracy] = []  # this validation epoch's accuracy, per head
        self._val_block_top1: dict[int, list[MulticlassAccuracy]] = {}
        self._val_block_norm: dict[int, torch.Tensor] = {}  # sum of the blocks' feature norms
        self._val_total = torch.zeros(1, dtype=torch.int64)  # samples it counted on this rank
        self._val_seen = 0  # samples of validation dataloader 0 seen by this rank this epoch
        self._val_nonfinite = False  # a non-finite feature seen this validation epoch

    @property
    def head(self) -> Optional[ProbeHead]:
        """The head of the first rate (the only one for a single ``lr``)."""
        return self.heads[0] if self.heads else None

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimiser of :attr:`head`."""
        return self.optimizers[0] if self.optimizers else None

    def identity(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer_name, "lr": self.given_lr, "momentum": self.momentum,
                "batch_norm": self.batch_norm, "seed": self.seed, "every_n_steps": self.every_n_steps,
                "max_samples": self.max_samples,
                # absent without replay: the key of the probes written before replay existed
                **({"replay_samples": self.replay_samples} if self.replay_samples is not None else {}),
                **({"blocks": self.blocks} if self.blocks else {})}

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        shared.release(trainer)  # every callback has read them (on_validation_epoch_end)
        write_pending(trainer)  # the per-block table and picture, once all contributors have added their rows

    def depth_rows(self, trainer: Trainer) -> list[dict[str, Any]]:
        """This instance's per-block rows (:mod:`lightning_mods.evaluation.over_depth`): fit's, or the last validate's."""
        return self.over_depth.rows(trainer)

    def tag_exclusions(self) -> tuple[str, ...]:
        return ("lr",) if self.multi_rate else ()

    def value_tags(self) -> list[str]:
        return [f"lr={format_setting(lr)}" for lr in self.lrs] if self.multi_rate else [""]

    @property
    def multi_rate(self) -> bool:
        return isinstance(self.given_lr, list)

    def metric_names_of(self, name: str) -> list[str]:
        """The logged names of vocabulary ``name``, one per head."""
        return [self.metric(name, value) for value in self.value_tags()]

    # --- head -------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.blocks is not None:
            require_blocks(pl_module, "OnlineLinearProbe: blocks")
        self._device = trainer.strategy.root_device
        shared.will_need(trainer, "val_dataset", self.blocks is not None)
        if self.num_classes is None:
            self.num_classes = getattr(getattr(trainer, "datamodule", None), "num_classes", None)
            if not self.num_classes:
                raise ValueError("OnlineLinearProbe: num_classes is not set and the datamodule has no num_classes")
        if self.feature_dim is None:
            self.feature_dim = getattr(pl_module, "num_features", None)
        if not self.heads and self.feature_dim is not None:
            self._build_heads(int(self.feature_dim))
        else:
            for head in self.heads + [h for heads in self.block_heads.values() for h in heads]:
                head.to(self._device)
        for replay in ([self.replay] if self.replay else []) + list(self.block_replay.values()):
            replay.to(self._device)

    def _new_heads(self, feature_dim: int) -> tuple[list[ProbeHead], list[torch.optim.Optimizer]]:
        """One head per rate, each initialised from ``seed`` (every rate and block starts alike)."""
        heads, optimizers = [], []
        for lr in self.lrs:
            with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global CPU RNG
                head = ProbeHead(feature_dim, int(self.num_classes), self.batch_norm,
                                 generator=torch.Generator().manual_seed(self.seed))
            head = head.to(self._device)
            params = list(head.parameters())
            if self.optimizer_name == "adamw":
                optimizer = adamw(params, lr=lr, weight_decay=0.0)
            else:
                optimizer = torch.optim.SGD(params, lr=lr, momentum=self.momentum, weight_decay=0.0)
            heads.append(head)
            optimizers.append(optimizer)
        return heads, optimizers

    def _build_heads(self, feature_dim: int) -> None:
        self.feature_dim = feature_dim
        self.heads, self.optimizers = self._new_heads(feature_dim)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._load_head_state(state)

    def _build_block_heads(self, dims: dict[int, int]) -> None:
        for block, dim in dims.items():
            self.block_heads[block], self.block_optimizers[block] = self._new_heads(dim)
        by_width: dict[int, list[int]] = {}
        for block, dim in dims.items():
            by_width.setdefault(dim, []).append(block)
        self._block_groups = [(rate, blocks, JointStep([self.block_optimizers[b][rate] for b in blocks]))
                              for rate in range(len(self.lrs)) for blocks in by_width.values()]
        if self._pending_blocks is not None:
            saved, self._pending_blocks = self._pending_blocks, None
            self._load_block_heads(saved)

    def _features(self, trainer: Trainer, pl_module: LightningModule,
                  images: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``forward_features`` and, with ``blocks``, each chosen block's pooled output, one pass."""
        with isolated_eval(pl_module), trainer.precision_plugin.forward_context():
            if self.blocks is None:
                features, outputs = pl_module.forward_features(images), []
            else:
                features, outputs = features_and_blocks(pl_module, images)
        return self._chosen(features, outputs)

    def _chosen(self, features: torch.Tensor,
                outputs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The features and the chosen blocks' outputs on the heads' device (heads built if needed)."""
        features = features.float()
        if not self.heads:
            self._build_heads(features.shape[1])
        elif features.ndim != 2 or features.shape[1] != self.feature_dim:
            raise ValueError(f"OnlineLinearProbe: forward_features gave shape {tuple(features.shape)}, the head "
                             f"expects B x {self.feature_dim} (set feature_dim)")
        chosen: dict[int, torch.Tensor] = {}
        if self.blocks is not None:
            blocks = self.block_heads.keys() or resolve_blocks("OnlineLinearProbe", self.blocks, len(outputs))
            chosen = {b: outputs[b - 1].float().to(self._device) for b in blocks}
            if not self.block_heads:
                self._build_block_heads({b: f.shape[1] for b, f in chosen.items()})
        return features.to(self._device), chosen

    # --- training ---------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        probe_now = self.batches % self.every_n_steps == 0
        self.batches += 1
        if not probe_now:
            return
        images, labels = batch[0][: self.max_samples], batch[1][: self.max_samples].to(self._device)
        if self.batch_norm and len(labels) < 2:
            return  # batch norm cannot train on one sample (DistributedSampler: same size on every rank)
        features, blocks = self._features(trainer, pl_module, images)
        if self.replay_samples is not None and is_distributed():  # one replay of every rank's samples, the
            # same on every rank: the checkpoint holds rank 0's state, which then resumes every rank exactly
            features, labels, blocks = _gather_probed(features, labels, blocks)
        self._learn_probed()  # the previous probe's samples: their check reached the host long ago
        self._probed = Probed(features, blocks, labels, *_nonfinite_flag_to_host(features, *blocks.values()))

    def _learn_probed(self) -> None:
        """The heads' steps on the probed samples waiting, if any: skipped (with a warning) when a
        feature was non-finite on any rank (a diverged backbone; the same decision on every rank).

        The steps wait for the next probe (or the epoch's end, a validation, the end of training)
        so that the check's flag, copied to the host asynchronously when the features were made,
        is read without stalling the device: no host sync per probe. The heads see the same
        samples in the same order, so they end up exactly as if each probe had stepped at once;
        a checkpoint in between keeps the waiting samples (``state_dict``)."""
        if self._probed is None:
            return
        probed, self._probed = self._probed, None
        if probed.copied is not None:
            probed.copied.synchronize()  # the flag's copy only, queued with the features
        if probed.nonfinite.numpy().any():  # a host buffer: no device read
            rank_zero_warn("OnlineLinearProbe: non-finite features, the heads skip this step")
            return
        features, labels = probed.features.to(self._device), probed.labels.to(self._device)
        blocks = {block: f.to(self._device) for block, f in probed.blocks.items()}
        if not self.heads:  # samples restored from a checkpoint before this run's first probe
            self._build_heads(features.shape[1])
        if blocks and not self.block_heads:
            self._build_block_heads({block: f.shape[1] for block, f in blocks.items()})
        if self.replay_samples is None:
            sums = self._train_heads(self.heads, self.optimizers, features, labels, scored=len(labels))
            self._train_block_heads(blocks, labels)
        else:
            sums = self._train_on_replay(features, labels, blocks)
        self.steps += 1
        # epoch means over the probed samples of every rank, summed on the device (no host read,
        # no logging call per step; under DDP one small all_reduce beside the heads' own) and
        # logged at the epoch's end; the sums, the same on every rank, are in the state_dict, so
        # a mid-epoch resume logs the uninterrupted run's means
        added = all_reduce_sum(sums)
        self._epoch_sums = added if self._epoch_sums is None else self._epoch_sums.to(added.device) + added

    def _train_heads(self, heads: list[ProbeHead], optimizers: list[torch.optim.Optimizer], features: torch.Tensor,
                     labels: torch.Tensor, scored: Optional[int] = None) -> Optional[torch.Tensor]:
        """One step of each head on ``(features, labels)``; with ``scored``, per head ``(loss x n,
        correct, n)`` over the first ``scored`` samples, from the logits before the step."""
        sums = []
        for head, optimizer in zip(heads, optimizers):
            losses, logits = self._step(head, optimizer, features, labels)
            if scored is not None:
                sums.append(torch.stack([losses[:scored].double().sum(),
                                         (logits[:scored].argmax(1) == labels[:scored]).sum().double(),
                                         torch.full((), float(scored), dtype=torch.float64, device=logits.device)]))
        return torch.stack(sums) if sums else None

    def _train_on_replay(self, features: torch.Tensor, labels: torch.Tensor,
                         blocks: dict[int, torch.Tensor]) -> torch.Tensor:
        """Add the probed samples to the replay, then sweep it once: ``every_n_steps`` head steps
        of ``replay_samples // every_n_steps`` samples, newest first (see
        :mod:`callbacks._utils.feature_replay`); under DDP every rank's samples (gathered at the probe).
        The sums score the fresh samples, in the first step."""
        if self.replay is None:
            self.replay = FeatureReplay(self.replay_samples)
        self.replay.add(features, labels)
        for block, block_features in blocks.items():
            self.block_replay.setdefault(block, FeatureReplay(self.replay_samples)).add(block_features, labels)
        size = self.replay_samples // self.every_n_steps
        for i in range(self.every_n_steps):
            rows = self.replay.rows(i * size, size)
            step_labels = self.replay.labels.index_select(0, rows)
            step_sums = self._train_heads(self.heads, self.optimizers, self.replay.features.index_select(0, rows),
                                          step_labels, scored=min(len(labels), len(rows)) if i == 0 else None)
            if i == 0:
                sums = step_sums
            # the same rows: the blocks' samples are the same
            self._train_block_heads({block: replay.features.index_select(0, rows)
                                     for block, replay in self.block_replay.items()}, step_labels)
        return sums

    def _train_block_heads(self, features: dict[int, torch.Tensor], labels: torch.Tensor) -> None:
        """One step of every block's heads on that block's features: the heads of one rate and
        one width step together (:mod:`callbacks._utils.probe_heads_together`)."""
        for rate, blocks, joint in self._block_groups:
            step_heads_together([self.block_heads[b][rate] for b in blocks], joint, [features[b] for b in blocks],
                                labels)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._learn_probed()  # the fitted heads have stepped on every probe

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._learn_probed()  # the epoch's last probe counts in its means
        if self._epoch_sums is None:
            return
        sums, self._epoch_sums = self._epoch_sums, None
        means = (sums[:, :2] / sums[:, 2:]).tolist()
        losses, tops = self.metric_names_of(metric_names.ONLINE_PROBE_TRAIN_LOSS), \
            self.metric_names_of(metric_names.ONLINE_PROBE_TRAIN_TOP1)
        metrics = {}
        for (loss, top1), loss_name, top_name in zip(means, losses, tops):
            metrics[loss_name], metrics[top_name] = loss, top1
        log_identical(pl_module, metrics)

    @staticmethod
    def _step(head: ProbeHead, optimizer: torch.optim.Optimizer, features: torch.Tensor,
              labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimiser step of ``head`` on the mean cross-entropy, averaged over ranks;
        ``(per-sample losses, logits)`` before the step.

        The gradients are written by hand, without an autograd graph (it took a quarter of a
        head step's time on the quickstart): the head's batch norm has no affine parameters, so
        only the linear layer learns, and the mean cross-entropy's gradient at the logits is
        ``(softmax - onehot) / N``; ``tests/test_feature_replay.py`` checks the steps against
        torch autograd (with batch norm) and float64 numpy (without)."""
        if not head.training:  # after a validation
            head.train()
        weight, bias = head.linear.weight, head.linear.bias
        with torch.no_grad():
            normed = head.norm(features.detach())  # batch statistics; updates the running ones
            logits = F.linear(normed, weight, bias)
            log_probs = F.log_softmax(logits, dim=1)
            losses = -log_probs.gather(1, labels.view(-1, 1)).squeeze(1)
            slope = cross_entropy_slope_(log_probs, labels)  # in place of log_probs, read above
            weight.grad = slope.t().mm(normed)
            bias.grad = slope.sum(0)
        average_across_ranks_(p.grad for p in head.parameters())
        optimizer.step()
        average_across_ranks_(b for b in head.buffers() if b.is_floating_point())
        return losses, logits

    # --- validation -------------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._learn_probed()  # the heads scored are those of every probe so far
        self._val_top1 = [top_k_accuracy(int(self.num_classes), 1).to(self._device) for _ in self.lrs]
        self._val_block_top1, self._val_block_norm = {}, {}
        self._add_block_accumulators(self.block_heads)
        self._val_total = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._val_seen = 0
        self._val_nonfinite = False

    def _add_block_accumulators(self, blocks: Any) -> None:
        for block in blocks:
            if block not in self._val_block_top1:
                self._val_block_top1[block] = [top_k_accuracy(int(self.num_classes), 1).to(self._device)
                                               for _ in self.lrs]
                self._val_block_norm[block] = torch.zeros((), dtype=torch.float64, device=self._device)

    def _shares_validation_features(self, trainer: Trainer) -> bool:
        """Whether the validation accuracy comes from the shared pass over the datamodule's
        ``val_dataset`` (:mod:`callbacks.measurement.shared_features`) rather than the validation loop's batches."""
        return getattr(getattr(trainer, "datamodule", None), "val_dataset", None) is not None

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking or dataloader_idx != 0 or self.steps == 0 or self._shares_validation_features(trainer):
            return
        images, labels = batch[0], batch[1].to(self._device)
        loaders = trainer.val_dataloaders
        loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
        real = distributed_padding_mask(loader, self._val_seen, len(labels))
        self._val_seen += len(labels)
        features, blocks = self._features(trainer, pl_module, images)
        if real is not None:
            keep = real.to(features.device)
            features, labels = features[keep], labels[real.to(labels.device)]
            blocks = {b: f[keep] for b, f in blocks.items()}
        self._score(features, labels, blocks)

    def _score_shared_features(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The heads on this rank's strided shard of the validation set, from the features kNN and
        effective rank read too (one pass for all of them)."""
        batch_size, num_workers = loader_settings(trainer, None, None)
        collected = shared_features(trainer, pl_module, "val_dataset", "OnlineLinearProbe", batch_size, num_workers,
                                    with_blocks=self.blocks is not None, gather=False)
        features, blocks = self._chosen(collected.features, collected.blocks or [])
        self._score(features, collected.labels.to(self._device), blocks)

    def _score(self, features: torch.Tensor, labels: torch.Tensor, blocks: dict[int, torch.Tensor]) -> None:
        self._add_block_accumulators(blocks)  # heads restored from a checkpoint are built at their first batch
        self._val_nonfinite = self._val_nonfinite or not bool(torch.isfinite(features).all())
        if not len(labels):  # a batch of padding only: torchmetrics refuses empty updates
            return
        with torch.no_grad():
            for head, accuracy in zip(self.heads, self._val_top1):
                head.eval()
                accuracy.update(head(features), labels)
            for block, block_features in blocks.items():
                for head, accuracy in zip(self.block_heads[block], self._val_block_top1[block]):
                    head.eval()
                    accuracy.update(head(block_features), labels)
                self._val_block_norm[block] += block_features.double().norm(dim=1).sum()
        self._val_total += len(labels)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self.steps == 0:
            return
        if self._shares_validation_features(trainer):
            self._score_shared_features(trainer, pl_module)
        nonfinite = int(all_reduce_sum(torch.tensor([int(self._val_nonfinite)], device=self._device)))
        total = int(all_reduce_sum(self._val_total))
        names = self.metric_names_of(metric_names.ONLINE_PROBE_VAL_TOP1)
        if nonfinite:
            rank_zero_warn("OnlineLinearProbe: non-finite validation features; logging NaN")
            log_identical(pl_module, {name: float("nan") for name in names})
        elif total:  # compute() sums the counts over ranks: every rank calls it
            log_identical(pl_module, {name: accuracy.compute().item() for name, accuracy in zip(names, self._val_top1)})
        if not self.block_heads or not total:
            return
        rows = []
        for block in sorted(self.block_heads):
            norm = all_reduce_sum(self._val_block_norm[block].view(1))
            values = {name: float("nan") if nonfinite else accuracy.compute().item()
                      for name, accuracy in zip(names, self._val_block_top1[block])}
            rows.append({"epoch": int(trainer.current_epoch), "step": int(trainer.global_step), "block": block,
                         **values, metric_names.FEATURE_NORM: float(norm) / total})
        self.over_depth.record(trainer, rows)

    # --- checkpoint -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """One rate: ``lr``, ``head`` and ``optimizer`` (the layout of every earlier checkpoint, which
        lacked ``lr``); several: ``heads``, one ``{"lr", "head", "optimizer"}`` per rate. A head
        trained at another rate than this probe's is refused on load."""
        if not self.heads:
            return dict(self._pending_state or {})
        heads = [{"lr": lr, "head": {k: v.detach().cpu().clone() for k, v in head.state_dict().items()},
                  "optimizer": copy.deepcopy(optimizer.state_dict())}
                 for lr, head, optimizer in zip(self.lrs, self.heads, self.optimizers)]
        state = {"feature_dim": self.feature_dim, "num_classes": self.num_classes, "steps": self.steps,
                 "batches": self.batches, "depth_history": [dict(row) for row in self.over_depth.depth_history],
                 "epoch_sums": None if self._epoch_sums is None else self._epoch_sums.detach().cpu().clone(),
                 "probed": None if self._probed is None else self._probed.state_dict()}
        if self.replay is not None:
            state["replay"] = {"features": self.replay.state_dict(),
                               "blocks": {block: replay.state_dict() for block, replay in self.block_replay.items()}}
        if self.block_heads:
            state["block_heads"] = {block: [{"lr": lr, "head": {k: v.detach().cpu().clone()
                                                              for k, v in head.state_dict().items()},
                                             "optimizer": copy.deepcopy(optimizer.state_dict())}
                                            for lr, head, optimizer in zip(self.lrs, heads, self.block_optimizers[block])]
                                    for block, heads in self.block_heads.items()}
        elif self._pending_blocks:
            state["block_heads"] = self._pending_blocks
        if self.multi_rate:
            return {**state, "heads": heads}
        return {**state, "lr": self.lrs[0], "head": heads[0]["head"], "optimizer": heads[0]["optimizer"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.over_depth.depth_history = [dict(row) for row in state_dict.get("depth_history", [])]
        self._epoch_sums = state_dict.get("epoch_sums")  # the interrupted epoch's probed samples so far
        saved = state_dict.get("probed")  # the samples the heads had not stepped on yet
        self._probed = None if saved is None else Probed.from_state(saved)
        if state_dict.get("replay") and self.replay_samples is not None:  # the state key holds replay_samples
            self.replay = FeatureReplay(self.replay_samples)
            self.replay.load_state_dict(state_dict["replay"]["features"], self._device)
            self.block_replay = {}
            for block, saved in state_dict["replay"]["blocks"].items():
                self.block_replay[int(block)] = FeatureReplay(self.replay_samples)
                self.block_replay[int(block)].load_state_dict(saved, self._device)
        if state_dict.get("block_heads"):
            if self.block_heads:
                self._load_block_heads(state_dict["block_heads"])
            else:  # built at the first batch, when the blocks' widths are known
                self._pending_blocks = dict(state_dict["block_heads"])
        if not self.heads:  # before setup, or a lazily sized head: applied when it is built
            self._pending_state = dict(state_dict)
            self.feature_dim = self.feature_dim or state_dict.get("feature_dim")
            self.batches = int(state_dict.get("batches", state_dict.get("steps", 0)))
            return
        self._load_head_state(state_dict)

    def _load_block_heads(self, saved: dict[int, list[dict[str, Any]]]) -> None:
        if sorted(saved) != sorted(self.block_heads):
            raise ValueError(f"OnlineLinearProbe: the checkpoint has heads for blocks {sorted(saved)}, this probe "
                             f"for {sorted(self.block_heads)}")
        for block, entries in saved.items():
            for entry, head, optimizer in zip(entries, self.block_heads[block], self.block_optimizers[block]):
                head.load_state_dict(entry["head"])
                optimizer.load_state_dict(entry["optimizer"])

    def _load_head_state(self, state_dict: dict[str, Any]) -> None:
        if (state_dict.get("feature_dim"), state_dict.get("num_classes")) != (self.feature_dim, self.num_classes):
            raise ValueError(f"OnlineLinearProbe: checkpoint head is {state_dict.get('feature_dim')} -> "
                             f"{state_dict.get('num_classes')} classes, this one {self.feature_dim} -> "
                             f"{self.num_classes}")
        # a single head's lr is in its state since the default lr changed (older states: the default's)
        saved = state_dict.get("heads") or [{"lr": state_dict.get("lr", self.lrs[0]), "head": state_dict["head"],
                                            "optimizer": state_dict["optimizer"]}]
        if [float(h["lr"]) for h in saved] != self.lrs:
            raise ValueError(f"OnlineLinearProbe: checkpoint heads were trained at lr {[h['lr'] for h in saved]}, "
                             f"this probe's are {self.lrs}")
        for entry, head, optimizer in zip(saved, self.heads, self.optimizers):
            head.load_state_dict(entry["head"])
            optimizer.load_state_dict(entry["optimizer"])
        self.steps = int(state_dict.get("steps", 0))
        self.batches = int(state_dict.get("batches", self.steps))  # older checkpoints: probed every batch


def _gather_probed(features: torch.Tensor, labels: torch.Tensor,
                   blocks: dict[int, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Every rank's probed samples (features, labels, block features) on every rank, rank
    order, in one all_gather (labels ride as float columns: exact below 2**24)."""
    parts = [features, *blocks.values(), labels.to(features.device, features.dtype).unsqueeze(1)]
    gathered = all_gather_rows(torch.cat(parts, dim=1))
    columns = gathered.split([p.shape[1] for p in parts], dim=1)
    return (columns[0], columns[-1].squeeze(1).round().to(labels.dtype).to(labels.device),
            dict(zip(blocks, columns[1:-1])))


@dataclass
class Probed:
    """One probe's samples waiting for the heads, and whether any feature was non-finite on any
    rank: ``nonfinite``, a host tensor that ``copied`` (a CUDA event, ``None`` elsewhere) says
    is filled."""

    features: torch.Tensor
    blocks: dict[int, torch.Tensor]
    labels: torch.Tensor
    nonfinite: torch.Tensor
    copied: Optional[Any] = None

    def state_dict(self) -> dict[str, Any]:
        if self.copied is not None:
            self.copied.synchronize()
        return {"features": self.features.detach().cpu().clone(), "labels": self.labels.detach().cpu().clone(),
                "blocks": {block: f.detach().cpu().clone() for block, f in self.blocks.items()},
                "nonfinite": self.nonfinite.clone()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Probed":
        return cls(state["features"], {int(b): f for b, f in state["blocks"].items()}, state["labels"],
                   state["nonfinite"])


def _nonfinite_flag_to_host(*features: torch.Tensor) -> tuple[torch.Tensor, Optional[Any]]:
    """Whether any of ``features`` is non-finite on any rank (one all_reduce under DDP), copied to
    a host tensor without waiting (on CUDA: pinned memory and an event recorded after the copy)."""
    flag = torch.logical_not(torch.stack([torch.isfinite(f).all() for f in features]).all()).to(torch.int64).view(1)
    flag = all_reduce_sum(flag)
    if flag.device.type != "cuda":
        return flag.cpu(), None
    host = torch.empty(1, dtype=torch.int64, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied
