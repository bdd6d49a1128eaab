"""The online probe's heads: one linear head per learning rate (and per chosen block), stacked by
width and stepped together (:mod:`callbacks.measurement.online_probe._stacked_heads`), each width's
replay (:mod:`callbacks.measurement.online_probe.replay`), with one ``state_dict`` in a per-head
layout. :class:`callbacks.measurement.online_probe.OnlineLinearProbe` decides when they learn and
logs what they score; this module is how they learn.

Heads are built lazily, when the first features say their width (or from ``feature_dim``); a
state restored before that is kept and applied when they are built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from ._stacked_heads import StackedHeads, mean_loss_target
from .linear_heads import LinearHeads
from .replay import Batches, FeatureReplay, ReplaySweep
from lightning_mods.evaluation._probe_head import ProbeHead

OWNER = "OnlineLinearProbe"
FINAL = "features"  # the member key of the heads on forward_features (block heads: the block's number)
Member = Union[str, int]


@dataclass
class WidthGroup:
    """The members (final features and blocks) of one width: per rate one :class:`StackedHeads`,
    and one replay of their features side by side (``capacity x (members x width)``)."""

    members: list[Member]
    width: int
    sets: list[StackedHeads]
    replay: Optional[FeatureReplay] = None

    def columns(self, member: Member) -> slice:
        start = self.members.index(member) * self.width
        return slice(start, start + self.width)


class OnlineProbeHeads:
    """The heads of one online probe (one per rate of ``lrs``, and per chosen block).

    Args:
        num_classes: the heads' outputs.
        settings: the heads' rates, optimiser, batch norm and seed (:class:`LinearHeads`).
        sweep: how fresh samples become head steps through a replay (``None``: one step on the
            fresh samples alone).
    """

    def __init__(self, num_classes: int, settings: LinearHeads, sweep: Optional[ReplaySweep] = None) -> None:
        self.num_classes, self.lrs = int(num_classes), settings.lrs
        self.optimizer_name, self.momentum = settings.optimizer, settings.momentum
        self.batch_norm, self.seed = settings.batch_norm, settings.seed
        self.sweep = sweep
        self.replay_samples = sweep.samples if sweep else None
        self.feature_dim: Optional[int] = None
        self.heads: list[ProbeHead] = []
        self.block_heads: dict[int, list[ProbeHead]] = {}  # per chosen block (1-based), one per rate
        self.groups: list[WidthGroup] = []
        self.steps = 0  # optimiser steps of the heads (they step together)
        self.device = torch.device("cpu")
        self._saved: dict[str, Any] = {}  # restored before the heads (or block heads) were built
        self._saved_replay: dict[Member, dict[str, Any]] = {}  # per member, until its group is built

    # --- building -------------------------------------------------------------------------------
    def to(self, device: torch.device) -> "OnlineProbeHeads":
        self.device = device
        for group in self.groups:
            for heads in group.sets:
                heads.to(device)
            if group.replay is not None:
                group.replay.to(device)
        return self

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Per rate, the optimiser stepping the final features' head (with the heads stacked beside it)."""
        sets = [self._locate(FINAL, rate)[0] for rate in range(len(self.lrs))] if self.heads else []
        for stacked in sets:
            stacked.apply_loaded_states()
        return [stacked.optimizer for stacked in sets]

    @property
    def replay(self) -> Optional[FeatureReplay]:
        """The replay holding the final features (beside the blocks' of the same width)."""
        return next((g.replay for g in self.groups if FINAL in g.members), None)

    def _locate(self, member: Member, rate: int) -> tuple[StackedHeads, int]:
        group = next(g for g in self.groups if member in g.members)
        return group.sets[rate], group.members.index(member)

    def _new_heads(self, feature_dim: int) -> list[ProbeHead]:
        """One head per rate, each initialised from ``seed`` (every rate and block starts alike)."""
        heads = []
        for _ in self.lrs:
            with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global CPU RNG
                head = ProbeHead(feature_dim, self.num_classes, self.batch_norm,
                                 generator=torch.Generator().manual_seed(self.seed))
            heads.append(head.to(self.device))
        return heads

    def build(self, feature_dim: int) -> None:
        """The heads of the features (width ``feature_dim``); a restored state is applied to them."""
        self.feature_dim = feature_dim
        self.heads = self._new_heads(feature_dim)
        self._regroup()
        if "heads" in self._saved:
            self._load_heads(self._saved.pop("heads"), self._saved.pop("feature_dim"))

    def build_blocks(self, dims: dict[int, int]) -> None:
        """The heads of each chosen block (``block -> width``); a restored state is applied to them."""
        for block, dim in dims.items():
            self.block_heads[block] = self._new_heads(dim)
        self._regroup()
        if "block_heads" in self._saved:
            self._load_block_heads(self._saved.pop("block_heads"))

    def _members(self) -> dict[Member, list[ProbeHead]]:
        return {**({FINAL: self.heads} if self.heads else {}), **self.block_heads}

    def _regroup(self) -> None:
        """Stack the heads by width, keeping every head's values, optimiser state and replay."""
        optimizer_states = {(member, rate): heads.member_optimizer_state(i)
                            for group in self.groups for rate, heads in enumerate(group.sets)
                            for i, member in enumerate(group.members)}
        self._saved_replay.update(self._replay_states())
        by_width: dict[int, list[Member]] = {}
        for member, heads in self._members().items():
            by_width.setdefault(heads[0].linear.in_features, []).append(member)
        members = self._members()
        self.groups = []
        for width, names in by_width.items():
            sets = [StackedHeads([members[m][rate] for m in names], self.optimizer_name, lr, self.momentum)
                    for rate, lr in enumerate(self.lrs)]
            self.groups.append(WidthGroup(names, width, sets))
            for rate, heads in enumerate(sets):
                for i, member in enumerate(names):
                    if (member, rate) in optimizer_states:
                        heads.load_member_optimizer_state(i, optimizer_states[member, rate])
        self._apply_saved_replays()

    def _apply_saved_replays(self) -> None:
        if self.replay_samples is None:
            return
        for group in self.groups:
            saved = [self._saved_replay.get(m) for m in group.members]
            if any(s is None for s in saved):
                continue
            states = [s for s in saved if s.get("features") is not None]
            replay = self.sweep.new_replay()
            if states:
                replay.load_state_dict({**states[0], "features": torch.cat([s["features"] for s in states], dim=1)},
                                       self.device)
            group.replay = replay
            for member in group.members:
                self._saved_replay.pop(member)

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

    def inputs(self, features: torch.Tensor, outputs: list[torch.Tensor],
               depth: Any) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The final features (float, on the heads' device) and the blocks ``depth`` chooses from
        ``outputs``; what is missing of the heads is built for their widths."""
        if features.ndim != 2:
            raise ValueError(f"{OWNER}: forward_features gave shape {tuple(features.shape)}, the head expects B x D")
        blocks = depth.choose(outputs, self.block_heads.keys(), self.device) if depth else {}
        self.ensure_built(features.shape[1], {b: f.shape[1] for b, f in blocks.items()})
        return features.float().to(self.device), blocks

    # --- learning -------------------------------------------------------------------------------
    def learn(self, features: torch.Tensor, labels: torch.Tensor, blocks: dict[int, torch.Tensor]) -> torch.Tensor:
        """The heads' steps on one probe's samples; per head on the final features ``(loss x n,
        correct, n)`` over those samples, from the logits before their first step."""
        self.ensure_built(features.shape[1], {block: f.shape[1] for block, f in blocks.items()})
        inputs: dict[Member, torch.Tensor] = {FINAL: features, **blocks}
        sums: list[Optional[torch.Tensor]] = [None] * len(self.lrs)
        for group in self.groups:
            side_by_side = torch.cat([inputs[m].detach() for m in group.members], dim=1) \
                if len(group.members) > 1 else inputs[group.members[0]].detach()
            scored = group.members.index(FINAL) if FINAL in group.members else None
            if self.sweep is None:
                batches: Batches = [(side_by_side, labels)]
            else:
                if group.replay is None:
                    group.replay = self.sweep.new_replay()
                batches = self.sweep.batches(group.replay, side_by_side, labels)
            self._steps(group, batches, scored, len(labels), sums)
        self.steps += 1
        return torch.stack(sums)

    def _steps(self, group: WidthGroup, batches: Batches, scored: Optional[int], fresh: int,
               sums: list[Optional[torch.Tensor]]) -> None:
        """Every rate's heads of ``group`` step on each batch in turn; the first batch's first
        ``fresh`` samples (the newest) are scored for the final features' heads."""
        labels = batches[0][1] if len(batches) == 1 else torch.cat([b[1] for b in batches])
        if len({len(b[1]) for b in batches}) != 1:
            raise ValueError(f"{OWNER}: a sweep's head batches differ in size: {[len(b[1]) for b in batches]}")
        targets = mean_loss_target(labels, self.num_classes, batches[0][0].dtype, len(batches[0][1])) \
            .split([len(b[1]) for b in batches], dim=1)
        for i, ((features, labels), target) in enumerate(zip(batches, targets)):
            for rate, heads in enumerate(group.sets):
                score = (scored, min(fresh, len(labels))) if scored is not None and i == 0 else None
                result = heads.step(features, labels, target, score)
                if result is not None:
                    sums[rate] = result

    # --- checkpoint -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``feature_dim``, ``num_classes``, ``steps``, ``heads`` (one ``{"lr", "head",
        "optimizer"}`` per rate), and with blocks or replay ``block_heads`` and ``replay``; a state
        restored but not yet applied is passed on as it came."""
        state: dict[str, Any] = {"num_classes": self.num_classes, "steps": self.steps, **self._saved}
        if self.heads:
            state.update(feature_dim=self.feature_dim, heads=self._head_states(FINAL, self.heads))
        replays = {**self._saved_replay, **self._replay_states()}
        if replays:
            state["replay"] = {"features": replays.get(FINAL),
                               "blocks": {m: s for m, s in replays.items() if m != FINAL}}
        if self.block_heads:
            state["block_heads"] = {block: self._head_states(block, heads) for block, heads in self.block_heads.items()}
        return state

    def _head_states(self, member: Member, heads: list[ProbeHead]) -> list[dict]:
        return [{"lr": lr, "head": {k: v.detach().cpu().clone() for k, v in head.state_dict().items()},
                 "optimizer": stacked.member_optimizer_state(i)}
                for rate, (lr, head) in enumerate(zip(self.lrs, heads))
                for stacked, i in (self._locate(member, rate),)]

    def _replay_states(self) -> dict[Member, dict[str, Any]]:
        """Each member's replay, in the layout of a replay of its features alone."""
        out = {}
        for group in self.groups:
            if group.replay is None:
                continue
            whole = group.replay.state_dict()
            for member in group.members:
                features = whole["features"]
                out[member] = {**whole, "features": None if features is None
                               else features[:, group.columns(member)].clone()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A state of :meth:`state_dict`, or of a single-rate probe's earlier layout (``lr``,
        ``head``, ``optimizer`` at the top)."""
        if state.get("num_classes") is not None and int(state["num_classes"]) != self.num_classes:
            raise ValueError(f"{OWNER}: checkpoint head is {state.get('feature_dim')} -> {state.get('num_classes')} "
                             f"classes, this one {self.feature_dim} -> {self.num_classes}")
        self.steps = int(state.get("steps", 0))
        if state.get("replay") and self.replay_samples is not None:  # the state key holds replay_samples
            saved = {FINAL: state["replay"]["features"],
                     **{int(b): s for b, s in state["replay"]["blocks"].items()}}
            for member, replay_state in saved.items():
                if replay_state is not None and int(replay_state["capacity"]) != self.replay_samples:
                    raise ValueError(f"FeatureReplay: the checkpoint replays {replay_state['capacity']} samples, "
                                     f"this probe {self.replay_samples}")
            self._saved_replay = {m: s for m, s in saved.items() if s is not None}
            for group in self.groups:
                group.replay = None
            self._apply_saved_replays()
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

    def _load_member(self, member: Member, heads: list[ProbeHead], entries: list[dict[str, Any]]) -> None:
        for rate, (entry, head) in enumerate(zip(entries, heads)):
            head.load_state_dict(entry["head"])  # into the stacked tensors its own are views of
            stacked, i = self._locate(member, rate)
            stacked.load_member_optimizer_state(i, entry["optimizer"])

    def _load_heads(self, heads: list[dict[str, Any]], feature_dim: Optional[int]) -> None:
        if feature_dim != self.feature_dim:
            raise ValueError(f"{OWNER}: checkpoint head is {feature_dim} -> {self.num_classes} classes, this one "
                             f"{self.feature_dim} -> {self.num_classes}")
        if [float(h["lr"]) for h in heads] != self.lrs:
            raise ValueError(f"{OWNER}: checkpoint heads were trained at lr {[h['lr'] for h in heads]}, "
                             f"this probe's are {self.lrs}")
        self._load_member(FINAL, self.heads, heads)

    def _load_block_heads(self, saved: dict[int, list[dict[str, Any]]]) -> None:
        if sorted(int(b) for b in saved) != sorted(self.block_heads):
            raise ValueError(f"{OWNER}: the checkpoint has heads for blocks {sorted(saved)}, this probe "
                             f"for {sorted(self.block_heads)}")
        for block, entries in saved.items():
            self._load_member(int(block), self.block_heads[int(block)], entries)
