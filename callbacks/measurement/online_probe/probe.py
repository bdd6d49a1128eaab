"""The :class:`OnlineLinearProbe` callback: its cadence, hooks, logging and state (how it works:
the package docstring, :mod:`callbacks.measurement.online_probe`)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics.classification import MulticlassAccuracy

from callbacks._utils.distributed import all_reduce_sum, is_distributed, log_identical
from callbacks._utils.feature_collection import loader_settings
from ._heads import OnlineProbeHeads, ValidationScores, check_settings
from ._probed_samples import Probed, gather_probed, nonfinite_flag_to_host
from callbacks.measurement.shared_features import SharedEvaluation
from callbacks.settings_key import SettingsKeyed, check_name, format_setting
from lightning_mods.evaluation import metric_names
from lightning_mods.evaluation._distributed_eval import padding_mask
from lightning_mods.evaluation._eval_mode import isolated_eval
from lightning_mods.evaluation.feature_contract import features_and_blocks, require_blocks
from lightning_mods.evaluation.over_depth import DepthRows, check_blocks, resolve_blocks, write_pending
from lightning_mods.evaluation._probe_head import ProbeHead
from callbacks.cost import PER_STEP

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
        replay_samples: keep the features of the last this many probed samples and take
            ``every_n_steps`` head steps on them per probe, newest first
            (:mod:`callbacks.measurement.online_probe._feature_replay`; in the state, for exact resumes); ``None``:
            one head step on the fresh samples alone.
        head_batch: samples of each replayed head step (default ``replay_samples //
            every_n_steps``: one sweep of the replay per probe; larger goes round it again).
        head_steps: replayed head steps per probe (default ``every_n_steps``: one per training
            batch).
        name: the tag of this instance's metric names when the Trainer has several (default:
            its settings that differ from the defaults).
        blocks: also train a head (per rate) on every chosen block's pooled output (``"all"`` or a
            list of indices, 1 = nearest the input, -1 = the last), from the same forward pass, each
            initialised from ``seed`` as a probe of that block alone would be; their validation
            accuracies and the blocks' feature norms go to ``eval_per_block.csv`` and the picture
            ``eval/over_depth`` (:mod:`lightning_mods.evaluation.over_depth`); the logged metrics stay those of the
            ``forward_features`` heads.
    """
    cost = PER_STEP

    def __init__(self, num_classes: Optional[int] = None, feature_dim: Optional[int] = None,
                 optimizer: Literal["adamw", "sgd"] = "adamw", lr: Union[float, list[float], None] = None,
                 momentum: float = 0.9, batch_norm: bool = True, seed: int = 0, every_n_steps: int = 4,
                 max_samples: Optional[int] = 16, replay_samples: Optional[int] = 512, name: Optional[str] = None,
                 blocks: Union[None, str, list[int]] = None, head_batch: Optional[int] = None,
                 head_steps: Optional[int] = None) -> None:
        super().__init__()
        self.blocks = check_blocks("OnlineLinearProbe", blocks)
        if num_classes is not None and num_classes < 2:
            raise ValueError(f"OnlineLinearProbe: num_classes must be >= 2 or None, got {num_classes!r}")
        if feature_dim is not None and feature_dim < 1:
            raise ValueError(f"OnlineLinearProbe: feature_dim must be >= 1 or None, got {feature_dim!r}")
        rates = check_settings(optimizer, lr, momentum, every_n_steps, max_samples, replay_samples, DEFAULT_LR)
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
        if head_batch is not None and (replay_samples is None or isinstance(head_batch, bool)
                                       or not isinstance(head_batch, int) or not 2 <= head_batch <= replay_samples):
            raise ValueError(f"OnlineLinearProbe: head_batch must be None or an integer from 2 to replay_samples "
                             f"({replay_samples}), got {head_batch!r}")
        self.head_batch = head_batch
        if head_steps is not None and (replay_samples is None or isinstance(head_steps, bool)
                                       or not isinstance(head_steps, int) or head_steps < 1):
            raise ValueError(f"OnlineLinearProbe: head_steps must be None or an integer >= 1 with a replay "
                             f"(replay_samples {replay_samples}), got {head_steps!r}")
        self.head_steps = head_steps
        self.name = check_name("OnlineLinearProbe", name)
        self.probe_heads: Optional[OnlineProbeHeads] = None  # built in setup, once num_classes is known
        self._restored: Optional[dict[str, Any]] = None  # a state loaded before setup
        self.over_depth = DepthRows()  # per-block rows of fit's validations (in the state) and the last validate's
        self._epoch_sums: Optional[torch.Tensor] = None  # this epoch's per-head (loss x n, correct, n) sums
        self._probed: Optional[Probed] = None  # the last probe's samples, until its check reaches the host
        self.batches = 0  # training batches seen (the cadence; in the state_dict for resumes)
        self._device = torch.device("cpu")
        self._scores: Optional[ValidationScores] = None  # this validation epoch's
        self._val_seen = 0
        self._val_top1: list[MulticlassAccuracy] = []  # this validation epoch's accuracy, per head
        self._val_block_top1: dict[int, list[MulticlassAccuracy]] = {}
        self._val_block_norm: dict[int, torch.Tensor] = {}  # sum of the blocks' feature norms
        self._val_total = torch.zeros(1, dtype=torch.int64)  # samples it counted on this rank
        self._val_seen = 0  # samples of validation dataloader 0 seen by this rank this epoch
        self._val_nonfinite = False  # a non-finite feature seen this validation epoch

    # --- the heads (callbacks.measurement.online_probe._heads) ---------------------------------------
    @property
    def heads(self) -> list[ProbeHead]:
        """One head per rate of :attr:`lrs` (empty until the features' width is known)."""
        return self.probe_heads.heads if self.probe_heads else []

    @property
    def head(self) -> Optional[ProbeHead]:
        """The head of the first rate (the only one for a single ``lr``)."""
        return self.heads[0] if self.heads else None

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimiser of :attr:`head`."""
        return self.probe_heads.optimizers[0] if self.heads else None

    @property
    def block_heads(self) -> dict[int, list[ProbeHead]]:
        return self.probe_heads.block_heads if self.probe_heads else {}

    @property
    def replay(self) -> Any:
        return self.probe_heads.replay if self.probe_heads else None

    @property
    def steps(self) -> int:
        """Optimiser steps the heads have taken (they step together)."""
        return self.probe_heads.steps if self.probe_heads else int((self._restored or {}).get("steps", 0))

    @steps.setter
    def steps(self, value: int) -> None:
        self._heads_object().steps = int(value)


    def identity(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer_name, "lr": self.given_lr, "momentum": self.momentum,
                "batch_norm": self.batch_norm, "seed": self.seed, "every_n_steps": self.every_n_steps,
                "max_samples": self.max_samples,
                # absent without replay: the key of the probes written before replay existed
                **({"replay_samples": self.replay_samples} if self.replay_samples is not None else {}),
                **({"head_batch": self.head_batch} if self.head_batch is not None else {}),
                **({"head_steps": self.head_steps} if self.head_steps is not None else {}),
                **({"blocks": self.blocks} if self.blocks else {})}

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
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

    # --- setup --------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.blocks is not None:
            require_blocks(pl_module, "OnlineLinearProbe: blocks")
        self._device = trainer.strategy.root_device
        SharedEvaluation.of(trainer).need("val_dataset", self.blocks is not None)
        if self.num_classes is None:
            self.num_classes = getattr(getattr(trainer, "datamodule", None), "num_classes", None)
            if not self.num_classes:
                raise ValueError("OnlineLinearProbe: num_classes is not set and the datamodule has no num_classes")
        self._heads_object().to(self._device)
        if self.feature_dim is None:
            self.feature_dim = getattr(pl_module, "num_features", None) or self.probe_heads.feature_dim
        if not self.heads and self.feature_dim is not None:
            self.build_heads(int(self.feature_dim))

    def _heads_object(self) -> OnlineProbeHeads:
        if self.probe_heads is None:
            self.probe_heads = OnlineProbeHeads(int(self.num_classes), self.lrs, self.optimizer_name, self.momentum,
                                                self.batch_norm, self.seed, self.every_n_steps, self.replay_samples,
                                                self.head_batch, self.head_steps)
            self.probe_heads.to(self._device)
            if self._restored is not None:
                restored, self._restored = self._restored, None
                self.probe_heads.load_state_dict(restored)
        return self.probe_heads

    def build_heads(self, feature_dim: int) -> None:
        """The heads for features of width ``feature_dim`` (``setup`` builds them when the width is
        known; otherwise the first features do); a restored state is applied to them."""
        self._heads_object().build(int(feature_dim))
        self.feature_dim = int(feature_dim)

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
        if features.ndim != 2:
            raise ValueError(f"OnlineLinearProbe: forward_features gave shape {tuple(features.shape)}, the head "
                             "expects B x D")
        chosen: dict[int, torch.Tensor] = {}
        if self.blocks is not None:
            blocks = self.block_heads.keys() or resolve_blocks("OnlineLinearProbe", self.blocks, len(outputs))
            chosen = {b: outputs[b - 1].float().to(self._device) for b in blocks}
        self._heads_object().ensure_built(features.shape[1], {b: f.shape[1] for b, f in chosen.items()})
        self.feature_dim = self.probe_heads.feature_dim
        return features.to(self._device), chosen

    # --- training -------------------------------------------------------------------------------
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
            features, labels, blocks = gather_probed(features, labels, blocks)
        self._learn_probed()  # the previous probe's samples: their check reached the host long ago
        self._probed = Probed(features, blocks, labels, *nonfinite_flag_to_host(features, *blocks.values()))

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
        sums = self._heads_object().learn(probed.features.to(self._device), probed.labels.to(self._device),
                                      {block: f.to(self._device) for block, f in probed.blocks.items()})
        # epoch means over the probed samples of every rank, summed on the device (no host read,
        # no logging call per step; under DDP one small all_reduce beside the heads' own) and
        # logged at the epoch's end; the sums, the same on every rank, are in the state_dict, so
        # a mid-epoch resume logs the uninterrupted run's means
        added = all_reduce_sum(sums)
        self._epoch_sums = added if self._epoch_sums is None else self._epoch_sums.to(added.device) + added

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

    # --- validation -----------------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._learn_probed()  # the heads scored are those of every probe so far
        self._scores = ValidationScores(self._heads_object()) if self.num_classes else None
        self._val_seen = 0  # samples of validation dataloader 0 seen by this rank this epoch

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
        real = padding_mask(loader, self._val_seen, len(labels))
        self._val_seen += len(labels)
        features, blocks = self._features(trainer, pl_module, images)
        if real is not None:  # the duplicates a DistributedSampler pads with are not counted
            keep = real.to(features.device)
            features, labels = features[keep], labels[real.to(labels.device)]
            blocks = {b: f[keep] for b, f in blocks.items()}
        self._scores.score(features, labels, blocks)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self.steps == 0:
            return
        if self._shares_validation_features(trainer):  # this rank's strided shard of the shared pass
            batch_size, num_workers = loader_settings(trainer, None, None)
            collected = SharedEvaluation.of(trainer).features(trainer, pl_module, "val_dataset", "OnlineLinearProbe", batch_size,
                                        num_workers, with_blocks=self.blocks is not None, gather=False)
            features, blocks = self._chosen(collected.features, collected.blocks or [])
            self._scores.score(features, collected.labels.to(self._device), blocks)
        names = self.metric_names_of(metric_names.ONLINE_PROBE_VAL_TOP1)
        nonfinite, total, values, blocks = self._scores.results(names)
        if nonfinite:
            rank_zero_warn("OnlineLinearProbe: non-finite validation features; logging NaN")
            log_identical(pl_module, {name: float("nan") for name in names})
        elif total:
            log_identical(pl_module, values)
        if blocks:
            self.over_depth.record(trainer, [{"epoch": int(trainer.current_epoch), "step": int(trainer.global_step),
                                              "block": block, **row} for block, row in blocks.items()])

    # --- checkpoint -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The heads' state (:class:`~callbacks.measurement.online_probe._heads.OnlineProbeHeads`) and the
        cadence's: batches seen, the epoch's sums so far, the samples waiting for the heads and the
        per-block rows."""
        heads = self.probe_heads.state_dict() if self.probe_heads else dict(self._restored or {})
        return {**heads, "batches": self.batches, "depth_history": [dict(row) for row in self.over_depth.depth_history],
                "epoch_sums": None if self._epoch_sums is None else self._epoch_sums.detach().cpu().clone(),
                "probed": None if self._probed is None else self._probed.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.over_depth.depth_history = [dict(row) for row in state_dict.get("depth_history", [])]
        self._epoch_sums = state_dict.get("epoch_sums")  # the interrupted epoch's probed samples so far
        saved = state_dict.get("probed")  # the samples the heads had not stepped on yet
        self._probed = None if saved is None else Probed.from_state(saved)
        self.batches = int(state_dict.get("batches", state_dict.get("steps", 0)))  # older: probed every batch
        heads = {k: v for k, v in state_dict.items() if k not in ("batches", "depth_history", "epoch_sums", "probed")}
        if self.probe_heads is None:  # before setup: applied there
            self._restored = heads
            self.feature_dim = self.feature_dim or heads.get("feature_dim")
        else:
            self.probe_heads.load_state_dict(heads)
