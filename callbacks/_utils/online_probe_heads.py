"""The online probe's heads: one linear head per learning rate (and per chosen block), their
optimisers, the hand-written head step, the feature replay and the joint step of the block heads,
with one ``state_dict``. :class:`callbacks.measurement.online_probe.OnlineLinearProbe` decides
when they learn and logs what they score; this module is how they learn.

Heads are built lazily, when the first features say their width (or from ``feature_dim``); a
state restored before that is kept and applied when they are built.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch
import torch.nn.functional as F

from callbacks._utils.distributed import all_reduce_sum, average_across_ranks_
from callbacks._utils.feature_replay import FeatureReplay
from callbacks._utils.probe_heads_together import JointStep, step_heads_together
from lightning_mods.evaluation.probe_head import ProbeHead, cross_entropy_slope_
from lightning_mods.evaluation import metric_names
from lightning_mods.training.classification_steps import top_k_accuracy
from lightning_mods.training.optim import adamw

OWNER = "OnlineLinearProbe"


def step_head(head: ProbeHead, optimizer: torch.optim.Optimizer, features: torch.Tensor,
              labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimiser step of ``head`` on the mean cross-entropy, averaged over ranks;
    ``(per-sample losses, logits)`` before the step.

    The gradients are written by hand, without an autograd graph (it took a quarter of a head
    step's time on the quickstart): the head's batch norm has no affine parameters, so only the
    linear layer learns, and the mean cross-entropy's gradient at the logits is
    ``(softmax - onehot) / N``; ``tests/callbacks/test_feature_replay.py`` checks the steps against torch
    autograd (with batch norm) and float64 numpy (without)."""
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


def _head_states(lrs: list[float], heads: list[ProbeHead], optimizers: list[torch.optim.Optimizer]) -> list[dict]:
    return [{"lr": lr, "head": {k: v.detach().cpu().clone() for k, v in head.state_dict().items()},
             "optimizer": copy.deepcopy(optimizer.state_dict())} for lr, head, optimizer in zip(lrs, heads, optimizers)]


class OnlineProbeHeads:
    """The heads of one online probe (one per rate of ``lrs``, and per chosen block).

    Args:
        num_classes, lrs, optimizer, momentum, batch_norm, seed: as the probe's settings.
        every_n_steps: head steps per probe when replaying.
        replay_samples: the replay's size (``None``: one step on the fresh samples alone).
    """

    def __init__(self, num_classes: int, lrs: list[float], optimizer: str, momentum: float, batch_norm: bool,
                 seed: int, every_n_steps: int, replay_samples: Optional[int]) -> None:
        self.num_classes, self.lrs = int(num_classes), list(lrs)
        self.optimizer_name, self.momentum, self.batch_norm, self.seed = optimizer, momentum, batch_norm, seed
        self.every_n_steps, self.replay_samples = every_n_steps, replay_samples
        self.feature_dim: Optional[int] = None
        self.heads: list[ProbeHead] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.block_heads: dict[int, list[ProbeHead]] = {}  # per chosen block (1-based), one per rate
        self.block_optimizers: dict[int, list[torch.optim.Optimizer]] = {}
        self._block_groups: list[tuple[int, list[int], JointStep]] = []  # per rate and width: heads stepped together
        self.replay: Optional[FeatureReplay] = None
        self.block_replay: dict[int, FeatureReplay] = {}
        self.steps = 0  # optimiser steps of the heads (they step together)
        self.device = torch.device("cpu")
        self._saved: dict[str, Any] = {}  # restored before the heads (or block heads) were built

    # --- building -------------------------------------------------------------------------------
    def to(self, device: torch.device) -> "OnlineProbeHeads":
        self.device = device
        for head in self.heads + [h for heads in self.block_heads.values() for h in heads]:
            head.to(device)
        for replay in ([self.replay] if self.replay else []) + list(self.block_replay.values()):
            replay.to(device)
        return self

    def _new_heads(self, feature_dim: int) -> tuple[list[ProbeHead], list[torch.optim.Optimizer]]:
        """One head per rate, each initialised from ``seed`` (every rate and block starts alike)."""
        heads, optimizers = [], []
        for lr in self.lrs:
            with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global CPU RNG
                head = ProbeHead(feature_dim, self.num_classes, self.batch_norm,
                                 generator=torch.Generator().manual_seed(self.seed))
            head = head.to(self.device)
            params = list(head.parameters())
            if self.optimizer_name == "adamw":
                optimizer = adamw(params, lr=lr, weight_decay=0.0)
            else:
                optimizer = torch.optim.SGD(params, lr=lr, momentum=self.momentum, weight_decay=0.0)
            heads.append(head)
            optimizers.append(optimizer)
        return heads, optimizers

    def build(self, feature_dim: int) -> None:
        """The heads of the features (width ``feature_dim``); a restored state is applied to them."""
        self.feature_dim = feature_dim
        self.heads, self.optimizers = self._new_heads(feature_dim)
        if "heads" in self._saved:
            self._load_heads(self._saved.pop("heads"), self._saved.pop("feature_dim"))

    def build_blocks(self, dims: dict[int, int]) -> None:
        """The heads of each chosen block (``block -> width``); a restored state is applied to them."""
        for block, dim in dims.items():
            self.block_heads[block], self.block_optimizers[block] = self._new_heads(dim)
        by_width: dict[int, list[int]] = {}
        for block, dim in dims.items():
            by_width.setdefault(dim, []).append(block)
        self._block_groups = [(rate, blocks, JointStep([self.block_optimizers[b][rate] for b in blocks]))
                              for rate in range(len(self.lrs)) for blocks in by_width.values()]
        if "block_heads" in self._saved:
            self._load_block_heads(self._saved.pop("block_heads"))

    def ensure_built(self, feature_dim: int, block_dims: dict[int, int]) -> None:
        """Build what is missing for features of these widths; a width other than the built heads'
        is a one-line error."""
        if not self.heads:
            self.build(feature_dim)
        elif feature_dim != self.feature_dim:
            raise ValueError(f"{OWNER}: forward_features gave width {feature_dim}, the head expects "
                             f"{self.feature_dim} (set feature_dim)")
        if block_dims and not self.block_heads:
            self.build_blocks(block_dims)

    # --- learning -------------------------------------------------------------------------------
    def learn(self, features: torch.Tensor, labels: torch.Tensor, blocks: dict[int, torch.Tensor]) -> torch.Tensor:
        """The heads' steps on one probe's samples; per head ``(loss x n, correct, n)`` over those
        samples, from the logits before their first step."""
        self.ensure_built(features.shape[1], {block: f.shape[1] for block, f in blocks.items()})
        if self.replay_samples is None:
            sums = self._train_heads(self.heads, self.optimizers, features, labels, scored=len(labels))
            self._train_block_heads(blocks, labels)
        else:
            sums = self._train_on_replay(features, labels, blocks)
        self.steps += 1
        return sums

    def _train_heads(self, heads: list[ProbeHead], optimizers: list[torch.optim.Optimizer], features: torch.Tensor,
                     labels: torch.Tensor, scored: Optional[int] = None) -> Optional[torch.Tensor]:
        """One step of each head on ``(features, labels)``; with ``scored``, per head ``(loss x n,
        correct, n)`` over the first ``scored`` samples, from the logits before the step."""
        sums = []
        for head, optimizer in zip(heads, optimizers):
            losses, logits = step_head(head, optimizer, features, labels)
            if scored is not None:
                sums.append(torch.stack([losses[:scored].double().sum(),
                                         (logits[:scored].argmax(1) == labels[:scored]).sum().double(),
                                         torch.full((), float(scored), dtype=torch.float64, device=logits.device)]))
        return torch.stack(sums) if sums else None

    def _train_on_replay(self, features: torch.Tensor, labels: torch.Tensor,
                         blocks: dict[int, torch.Tensor]) -> torch.Tensor:
        """Add the samples to the replay, then sweep it once: ``every_n_steps`` head steps of
        ``replay_samples // every_n_steps`` samples, newest first (:mod:`callbacks._utils.feature_replay`).
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
        """One step of every block's heads on that block's features: the heads of one rate and one
        width step together (:mod:`callbacks._utils.probe_heads_together`)."""
        for rate, blocks, joint in self._block_groups:
            step_heads_together([self.block_heads[b][rate] for b in blocks], joint, [features[b] for b in blocks],
                                labels)

    # --- checkpoint -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``feature_dim``, ``num_classes``, ``steps``, ``heads`` (one ``{"lr", "head",
        "optimizer"}`` per rate), and with blocks or replay ``block_heads`` and ``replay``; a state
        restored but not yet applied is passed on as it came."""
        state: dict[str, Any] = {"num_classes": self.num_classes, "steps": self.steps, **self._saved}
        if self.heads:
            state.update(feature_dim=self.feature_dim, heads=_head_states(self.lrs, self.heads, self.optimizers))
        if self.replay is not None:
            state["replay"] = {"features": self.replay.state_dict(),
                               "blocks": {block: replay.state_dict() for block, replay in self.block_replay.items()}}
        if self.block_heads:
            state["block_heads"] = {block: _head_states(self.lrs, heads, self.block_optimizers[block])
                                    for block, heads in self.block_heads.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A state of :meth:`state_dict`, or of a single-rate probe's earlier layout (``lr``,
        ``head``, ``optimizer`` at the top)."""
        if state.get("num_classes") is not None and int(state["num_classes"]) != self.num_classes:
            raise ValueError(f"{OWNER}: checkpoint head is {state.get('feature_dim')} -> {state.get('num_classes')} "
                             f"classes, this one {self.feature_dim} -> {self.num_classes}")
        self.steps = int(state.get("steps", 0))
        if state.get("replay") and self.replay_samples is not None:  # the state key holds replay_samples
            self.replay = FeatureReplay(self.replay_samples)
            self.replay.load_state_dict(state["replay"]["features"], self.device)
            self.block_replay = {}
            for block, saved in state["replay"]["blocks"].items():
                self.block_replay[int(block)] = FeatureReplay(self.replay_samples)
                self.block_replay[int(block)].load_state_dict(saved, self.device)
        if state.get("block_heads"):
            if self.block_heads:
                self._load_block_heads(state["block_heads"])
            else:  # built at the first batch, when the blocks' widths are known
                self._saved["block_heads"] = dict(state["block_heads"])
        heads = state.get("heads")
        if heads is None and "head" in state:  # a single rate's earlier layout (its lr saved since the default changed)
            heads = [{"lr": state.get("lr", self.lrs[0]), "head": state["head"], "optimizer": state["optimizer"]}]
        if heads is None:
            return
        if self.heads:
            self._load_heads(heads, state.get("feature_dim"))
        else:  # a lazily sized head: applied when it is built
            self._saved.update(heads=heads, feature_dim=state.get("feature_dim"))
            self.feature_dim = self.feature_dim or state.get("feature_dim")

    def _load_heads(self, heads: list[dict[str, Any]], feature_dim: Optional[int]) -> None:
        if feature_dim != self.feature_dim:
            raise ValueError(f"{OWNER}: checkpoint head is {feature_dim} -> {self.num_classes} classes, this one "
                             f"{self.feature_dim} -> {self.num_classes}")
        if [float(h["lr"]) for h in heads] != self.lrs:
            raise ValueError(f"{OWNER}: checkpoint heads were trained at lr {[h['lr'] for h in heads]}, "
                             f"this probe's are {self.lrs}")
        for entry, head, optimizer in zip(heads, self.heads, self.optimizers):
            head.load_state_dict(entry["head"])
            optimizer.load_state_dict(entry["optimizer"])

    def _load_block_heads(self, saved: dict[int, list[dict[str, Any]]]) -> None:
        if sorted(int(b) for b in saved) != sorted(self.block_heads):
            raise ValueError(f"{OWNER}: the checkpoint has heads for blocks {sorted(saved)}, this probe "
                             f"for {sorted(self.block_heads)}")
        for block, entries in saved.items():
            for entry, head, optimizer in zip(entries, self.block_heads[int(block)], self.block_optimizers[int(block)]):
                head.load_state_dict(entry["head"])
                optimizer.load_state_dict(entry["optimizer"])


class ValidationScores:
    """One validation epoch's top-1 of every head (and block head), and the blocks' mean feature
    norms; torchmetrics counts, summed over ranks when read."""

    def __init__(self, heads: OnlineProbeHeads) -> None:
        self.heads, self.device = heads, heads.device
        self.top1 = [self._accuracy() for _ in heads.lrs]
        self.block_top1: dict[int, list] = {}
        self.block_norm: dict[int, torch.Tensor] = {}
        self.total = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.nonfinite = False
        self._add_blocks(heads.block_heads)

    def _accuracy(self) -> Any:
        return top_k_accuracy(self.heads.num_classes, 1).to(self.device)

    def _add_blocks(self, blocks: Any) -> None:
        for block in blocks:
            if block not in self.block_top1:
                self.block_top1[block] = [self._accuracy() for _ in self.heads.lrs]
                self.block_norm[block] = torch.zeros((), dtype=torch.float64, device=self.device)

    def score(self, features: torch.Tensor, labels: torch.Tensor, blocks: dict[int, torch.Tensor]) -> None:
        """Add one batch (this rank's samples, none twice) to the counts."""
        self._add_blocks(blocks)  # heads restored from a checkpoint are built at their first batch
        self.nonfinite = self.nonfinite or not bool(torch.isfinite(features).all())
        if not len(labels):  # a batch of padding only: torchmetrics refuses empty updates
            return
        with torch.no_grad():
            for head, accuracy in zip(self.heads.heads, self.top1):
                head.eval()
                accuracy.update(head(features), labels)
            for block, block_features in blocks.items():
                for head, accuracy in zip(self.heads.block_heads[block], self.block_top1[block]):
                    head.eval()
                    accuracy.update(head(block_features), labels)
                self.block_norm[block] += block_features.double().norm(dim=1).sum()
        self.total += len(labels)

    def results(self, names: list[str]) -> tuple[bool, int, dict[str, float], dict[int, dict[str, float]]]:
        """``(any non-finite feature, samples counted, {name: top-1}, {block: {name: top-1,
        feature/norm}})`` over every rank (collectives: every rank calls it); NaN where a feature
        was non-finite."""
        nonfinite = bool(int(all_reduce_sum(torch.tensor([int(self.nonfinite)], device=self.device))))
        total = int(all_reduce_sum(self.total))
        if not total:
            return nonfinite, 0, {}, {}

        def read(accuracies: list) -> dict[str, float]:  # compute() sums the counts over ranks
            return {name: float("nan") if nonfinite else accuracy.compute().item()
                    for name, accuracy in zip(names, accuracies)}

        blocks = {block: {**read(self.block_top1[block]),
                          metric_names.FEATURE_NORM: float(all_reduce_sum(self.block_norm[block].view(1))) / total}
                  for block in sorted(self.heads.block_heads)}
        return nonfinite, total, read(self.top1), blocks


def check_settings(optimizer: str, lr: Any, momentum: float, every_n_steps: int, max_samples: Optional[int],
                   replay_samples: Optional[int], default_lr: dict[str, float]) -> list[Optional[float]]:
    """The probe's head settings checked (a one-line ValueError naming the bad one); the rates."""
    def whole(value: Any, least: int) -> bool:
        return not isinstance(value, bool) and isinstance(value, int) and value >= least

    if optimizer not in default_lr:
        raise ValueError(f"{OWNER}: optimizer must be one of {tuple(default_lr)}, got {optimizer!r}")
    rates = list(lr) if isinstance(lr, (list, tuple)) else [lr]
    if not rates or (isinstance(lr, (list, tuple)) and None in rates) or any(
            r is not None and (isinstance(r, bool) or not r > 0) for r in rates):
        raise ValueError(f"{OWNER}: lr must be > 0, a non-empty list of rates > 0, or None, got {lr!r}")
    if len(set(rates)) != len(rates):
        raise ValueError(f"{OWNER}: lr lists a rate twice: {lr!r}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"{OWNER}: momentum must be in [0, 1), got {momentum!r}")
    if not whole(every_n_steps, 1):
        raise ValueError(f"{OWNER}: every_n_steps must be an integer >= 1, got {every_n_steps!r}")
    if max_samples is not None and not whole(max_samples, 2):
        raise ValueError(f"{OWNER}: max_samples must be an integer >= 2 or None, got {max_samples!r}")
    if replay_samples is not None and not (whole(replay_samples, 2) and replay_samples // every_n_steps >= 2):
        raise ValueError(f"{OWNER}: replay_samples must be None or an integer with at least 2 samples per head step "
                         f"(replay_samples // every_n_steps >= 2), got {replay_samples!r}")
    return rates
