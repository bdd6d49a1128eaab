"""The :class:`OnlineLinearProbe` callback: a linear head on detached features, trained during
pre-training and measured at validation (the pieces it adds: :mod:`callbacks.measurement.online_probe`)."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from callbacks._utils.distributed import all_reduce_sum, is_distributed, log_identical
from callbacks._utils.feature_collection import loader_settings
from callbacks.cost import PER_STEP
from callbacks.measurement.shared_features import SharedEvaluation
from callbacks.settings_key import SettingsKeyed, check_name
from lightning_mods.evaluation import metric_names
from lightning_mods.evaluation._distributed_eval import padding_mask
from lightning_mods.evaluation._eval_mode import isolated_eval
from lightning_mods.evaluation._probe_head import ProbeHead
from lightning_mods.evaluation.over_depth import DepthRows, write_pending
from ._heads import OnlineProbeHeads
from ._probed_samples import Probed, gather_probed, nonfinite_flag_to_host
from ._validation_scores import ValidationScores
from .depth_heads import DepthHeads
from .rates import ProbeRates
from .replay import is_whole_number, replay_sweep

OWNER = "OnlineLinearProbe"


class OnlineLinearProbe(SettingsKeyed):
    """Train a linear probe on detached features during pre-training.

    Every ``every_n_steps``-th training batch it embeds the batch's first ``max_samples`` images
    with ``pl_module.forward_features`` (eval mode, no grad, RNG states forked: the pre-training
    is the same run with and without it) and steps its head (BatchNorm without affine, as MAE's
    linear probe, then Linear) on them. At validation it scores every validation sample once and
    logs ``online_probe/val_top1``; ``online_probe/train_loss`` and ``online_probe/train_top1``
    are epoch means over the fresh probed samples. ``every_n_steps=1, max_samples=None,
    replay_samples=None`` is lightly's every-batch probe.

    The pieces that buy its accuracy at a fraction of the cost (each its own module):
    ``replay_samples`` (:mod:`~callbacks.measurement.online_probe.replay`; with ``head_batch``,
    ``head_steps``), a list of ``lr`` (:mod:`~callbacks.measurement.online_probe.rates`) and
    ``blocks`` (:mod:`~callbacks.measurement.online_probe.depth_heads`).

    Args:
        num_classes: classes of the labels (default: the datamodule's ``num_classes``).
        feature_dim: width of ``forward_features`` (default: the module's ``num_features``, else
            the first features').
        optimizer: ``"adamw"`` or ``"sgd"`` (momentum ``momentum``); weight decay 0 either way.
        lr: learning rate (default 2e-2 for AdamW, 0.1 for SGD), or a list: one head per rate.
        batch_norm: BatchNorm1d without affine before the linear layer.
        seed: seed of the heads' initialisation (the same heads on every rank, no global RNG draw).
        every_n_steps: probe every n-th training batch; max_samples: of its first this many samples.
        replay_samples: replay the last this many probed samples, ``every_n_steps`` head steps per
            probe (``None``: one step on the fresh samples alone).
        name: the tag of this instance's metric names when the Trainer has several.
        blocks: also a head per chosen block (``"all"`` or indices), rows in ``eval_per_block.csv``.
    """
    cost = PER_STEP

    def __init__(self, num_classes: Optional[int] = None, feature_dim: Optional[int] = None,
                 optimizer: Literal["adamw", "sgd"] = "adamw", lr: Union[float, list[float], None] = None,
                 momentum: float = 0.9, batch_norm: bool = True, seed: int = 0, every_n_steps: int = 4,
                 max_samples: Optional[int] = 16, replay_samples: Optional[int] = 512, name: Optional[str] = None,
                 blocks: Union[None, str, list[int]] = None, head_batch: Optional[int] = None,
                 head_steps: Optional[int] = None) -> None:
        super().__init__()
        for setting, value, least in (("num_classes", num_classes, 2), ("feature_dim", feature_dim, 1)):
            if value is not None and not is_whole_number(value, least):
                raise ValueError(f"{OWNER}: {setting} must be >= {least} or None, got {value!r}")
        self.rates = ProbeRates(lr, optimizer)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"{OWNER}: momentum must be in [0, 1), got {momentum!r}")
        if not is_whole_number(every_n_steps, 1):
            raise ValueError(f"{OWNER}: every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        if max_samples is not None and not is_whole_number(max_samples, 2):
            raise ValueError(f"{OWNER}: max_samples must be an integer >= 2 or None, got {max_samples!r}")
        self.sweep = replay_sweep(replay_samples, every_n_steps, head_batch, head_steps)
        self.over_depth = DepthRows()  # per-block rows of fit's validations (in the state) and the last validate's
        self.depth = DepthHeads(blocks, self.over_depth) if blocks is not None else None
        self.num_classes, self.feature_dim, self.optimizer_name = num_classes, feature_dim, optimizer
        self.momentum, self.batch_norm, self.seed = float(momentum), batch_norm, int(seed)
        self.every_n_steps, self.max_samples, self.replay_samples = every_n_steps, max_samples, replay_samples
        self.head_batch, self.head_steps = head_batch, head_steps
        self.blocks = self.depth.blocks if self.depth else None
        self.name = check_name(OWNER, name)
        self.lrs, self.lr = self.rates.lrs, self.rates.lrs[0]
        self.probe_heads: Optional[OnlineProbeHeads] = None  # built once num_classes is known
        self._restored: Optional[dict[str, Any]] = None  # a state loaded before setup
        self._epoch_sums: Optional[torch.Tensor] = None  # this epoch's per-head (loss x n, correct, n) sums
        self._probed: Optional[Probed] = None  # the last probe's samples, until their check reaches the host
        self.batches = 0  # training batches seen (the cadence; in the state)
        self._device = torch.device("cpu")
        self._scores: Optional[ValidationScores] = None  # this validation epoch's
        self._val_seen = 0  # samples of validation dataloader 0 this rank saw this epoch

    # --- what it is ---------------------------------------------------------------------------
    @property
    def heads(self) -> list[ProbeHead]:
        """One head per rate (empty until the features' width is known); :attr:`head` the first."""
        return self.probe_heads.heads if self.probe_heads else []

    @property
    def head(self) -> Optional[ProbeHead]:
        return self.heads[0] if self.heads else None

    @property
    def block_heads(self) -> dict[int, list[ProbeHead]]:
        return self.probe_heads.block_heads if self.probe_heads else {}

    @property
    def steps(self) -> int:
        """Probes the heads have stepped on."""
        return self.probe_heads.steps if self.probe_heads else int((self._restored or {}).get("steps", 0))

    def identity(self) -> dict[str, Any]:
        optional = {"replay_samples": self.replay_samples, "head_batch": self.head_batch,
                    "head_steps": self.head_steps, "blocks": self.blocks or None}
        return {"optimizer": self.optimizer_name, "lr": self.rates.given, "momentum": self.momentum,
                "batch_norm": self.batch_norm, "seed": self.seed, "every_n_steps": self.every_n_steps,
                "max_samples": self.max_samples, **{k: v for k, v in optional.items() if v is not None}}

    def tag_exclusions(self) -> tuple[str, ...]:
        return ("lr",) if self.rates.several else ()

    def value_tags(self) -> list[str]:
        return self.rates.tags()

    def metric_names_of(self, name: str) -> list[str]:
        """The logged names of vocabulary ``name``, one per head."""
        return [self.metric(name, tag) for tag in self.value_tags()]

    def depth_rows(self, trainer: Trainer) -> list[dict[str, Any]]:
        return self.over_depth.rows(trainer)

    # --- setup --------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.depth:
            self.depth.setup(pl_module)
        self._device = trainer.strategy.root_device
        SharedEvaluation.of(trainer).need("val_dataset", self.depth is not None)
        if self.num_classes is None:
            self.num_classes = getattr(getattr(trainer, "datamodule", None), "num_classes", None)
            if not self.num_classes:
                raise ValueError(f"{OWNER}: num_classes is not set and the datamodule has no num_classes")
        self._heads_object().to(self._device)
        self.feature_dim = self.feature_dim or getattr(pl_module, "num_features", None) or self.probe_heads.feature_dim
        if not self.heads and self.feature_dim is not None:
            self.build_heads(int(self.feature_dim))

    def _heads_object(self) -> OnlineProbeHeads:
        if self.probe_heads is None:
            self.probe_heads = OnlineProbeHeads(int(self.num_classes), self.lrs, self.optimizer_name, self.momentum,
                                                self.batch_norm, self.seed, self.sweep).to(self._device)
            if self._restored is not None:
                restored, self._restored = self._restored, None
                self.probe_heads.load_state_dict(restored)
        return self.probe_heads

    def build_heads(self, feature_dim: int) -> None:
        """The heads for features of width ``feature_dim`` (a restored state is applied to them)."""
        self._heads_object().build(int(feature_dim))
        self.feature_dim = int(feature_dim)

    def _features(self, trainer: Trainer, pl_module: LightningModule,
                  images: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The detached features (and the chosen blocks'), on the heads' device; heads built if needed."""
        with isolated_eval(pl_module), trainer.precision_plugin.forward_context():
            features, outputs = (self.depth.forward(pl_module, images) if self.depth
                                 else (pl_module.forward_features(images), []))
        return self._chosen(features, outputs)

    def _chosen(self, features: torch.Tensor,
                outputs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        if features.ndim != 2:
            raise ValueError(f"{OWNER}: forward_features gave shape {tuple(features.shape)}, the head expects B x D")
        blocks = self.depth.choose(outputs, self.block_heads.keys(), self._device) if self.depth else {}
        self._heads_object().ensure_built(features.shape[1], {b: f.shape[1] for b, f in blocks.items()})
        self.feature_dim = self.probe_heads.feature_dim
        return features.float().to(self._device), blocks

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
        if self.sweep is not None and is_distributed():  # one replay of every rank's samples on every
            # rank: rank 0's checkpoint then resumes every rank exactly
            features, labels, blocks = gather_probed(features, labels, blocks)
        self._learn_probed()  # the previous probe's samples: their check reached the host long ago
        self._probed = Probed(features, blocks, labels, *nonfinite_flag_to_host(features, *blocks.values()))

    def _learn_probed(self) -> None:
        """The heads step on the waiting probe's samples, unless a feature was non-finite on any rank.

        The steps wait for the next probe (or the epoch's end, a validation, the end of training)
        so that the finiteness flag, copied to the host asynchronously, is read without stalling
        the device; the heads see the same samples in the same order, and a checkpoint in between
        keeps the waiting samples."""
        if self._probed is None:
            return
        probed, self._probed = self._probed, None
        if probed.copied is not None:
            probed.copied.synchronize()  # the flag's copy only, queued with the features
        if probed.nonfinite.numpy().any():  # a host buffer: no device read
            rank_zero_warn(f"{OWNER}: non-finite features, the heads skip this step")
            return
        sums = self._heads_object().learn(probed.features.to(self._device), probed.labels.to(self._device),
                                          {block: f.to(self._device) for block, f in probed.blocks.items()})
        added = all_reduce_sum(sums)  # every rank's fresh samples, summed on the device, logged per epoch
        self._epoch_sums = added if self._epoch_sums is None else self._epoch_sums.to(added.device) + added

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._learn_probed()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._learn_probed()  # the epoch's last probe counts in its means
        if self._epoch_sums is None:
            return
        sums, self._epoch_sums = self._epoch_sums, None
        means = (sums[:, :2] / sums[:, 2:]).tolist()
        names = zip(self.metric_names_of(metric_names.ONLINE_PROBE_TRAIN_LOSS),
                    self.metric_names_of(metric_names.ONLINE_PROBE_TRAIN_TOP1))
        log_identical(pl_module, {name: value for pair, values in zip(names, means) for name, value in zip(pair, values)})

    # --- validation -----------------------------------------------------------------------------
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._learn_probed()  # the heads scored are those of every probe so far
        self._scores = ValidationScores(self._heads_object()) if self.num_classes else None
        self._val_seen = 0

    @staticmethod
    def _shares_validation_features(trainer: Trainer) -> bool:
        """Whether validation reads the shared pass over the datamodule's ``val_dataset``
        (:mod:`callbacks.measurement.shared_features`) rather than the validation loop's batches."""
        return getattr(getattr(trainer, "datamodule", None), "val_dataset", None) is not None

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.sanity_checking or dataloader_idx != 0 or self.steps == 0 or self._shares_validation_features(trainer):
            return
        images, labels = batch[0], batch[1].to(self._device)
        loaders = trainer.val_dataloaders
        real = padding_mask(loaders[0] if isinstance(loaders, (list, tuple)) else loaders, self._val_seen, len(labels))
        self._val_seen += len(labels)
        features, blocks = self._features(trainer, pl_module, images)
        if real is not None:  # the duplicates a DistributedSampler pads with are not counted
            keep = real.to(features.device)
            features, labels, blocks = features[keep], labels[keep], {b: f[keep] for b, f in blocks.items()}
        self._scores.score(features, labels, blocks)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self.steps == 0:
            return
        if self._shares_validation_features(trainer):  # this rank's strided shard of the shared pass
            batch_size, num_workers = loader_settings(trainer, None, None)
            collected = SharedEvaluation.of(trainer).features(trainer, pl_module, "val_dataset", OWNER, batch_size,
                                                              num_workers, with_blocks=self.depth is not None,
                                                              gather=False)
            features, blocks = self._chosen(collected.features, collected.blocks or [])
            self._scores.score(features, collected.labels.to(self._device), blocks)
        names = self.metric_names_of(metric_names.ONLINE_PROBE_VAL_TOP1)
        nonfinite, total, values, blocks = self._scores.results(names)
        if nonfinite:
            rank_zero_warn(f"{OWNER}: non-finite validation features; logging NaN")
            log_identical(pl_module, {name: float("nan") for name in names})
        elif total:
            log_identical(pl_module, values)
        if self.depth:
            self.depth.record(trainer, blocks)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        write_pending(trainer)  # the per-block table and picture, once all contributors have added their rows

    # --- checkpoint -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The heads' state (:class:`~callbacks.measurement.online_probe._heads.OnlineProbeHeads`),
        the batches seen, the epoch's sums so far, the samples waiting and the per-block rows."""
        heads = self.probe_heads.state_dict() if self.probe_heads else dict(self._restored or {})
        return {**heads, "batches": self.batches, "depth_history": [dict(row) for row in self.over_depth.depth_history],
                "epoch_sums": None if self._epoch_sums is None else self._epoch_sums.detach().cpu().clone(),
                "probed": None if self._probed is None else self._probed.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self.over_depth.depth_history = [dict(row) for row in state_dict.get("depth_history", [])]
        self._epoch_sums = state_dict.get("epoch_sums")
        saved = state_dict.get("probed")
        self._probed = None if saved is None else Probed.from_state(saved)
        self.batches = int(state_dict.get("batches", state_dict.get("steps", 0)))  # older: probed every batch
        heads = {k: v for k, v in state_dict.items() if k not in ("batches", "depth_history", "epoch_sums", "probed")}
        if self.probe_heads is None:  # before setup: applied there
            self._restored = heads
            self.feature_dim = self.feature_dim or heads.get("feature_dim")
        else:
            self.probe_heads.load_state_dict(heads)
