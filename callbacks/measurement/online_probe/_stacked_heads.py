"""Probe heads of one width and one learning rate held as one stacked set and stepped together.

The online probe trains a head on the final features and, with ``blocks``, one per encoder
block: on the quickstart 13 small heads, each a batch norm without affine parameters and a
linear layer, stepped once per training batch. Stepped one by one, or stacked anew every step,
that was some 140 dispatched operations a training step (on a GPU about 10 us of host time
each). Here the heads' tensors live stacked from the start, ``H x C x D`` weights, ``H x C``
biases and ``H x D`` running statistics, and a step is a fixed handful of calls whatever ``H``:

- one ``batch_norm`` over the ``N x (H x D)`` features (per-head, per-channel batch statistics;
  the running statistics updated in place in the stacked buffers);
- one ``baddbmm`` for the logits, the mean cross-entropy's slope ``(softmax - onehot) / N``
  and one ``bmm`` for the weight gradients (the gradients written by hand: no autograd graph);
- one optimiser step (AdamW fused where the kernel exists, else SGD with momentum) over the two
  stacked parameters: Adam and SGD are elementwise, so each head's update is its own.

Each member keeps a :class:`~lightning_mods.evaluation._probe_head.ProbeHead` whose parameters
and buffers are views of the stacked tensors (what validation scores and ``state_dict`` read),
and its optimiser state can be read and written in the layout of a per-head optimiser, so
checkpoints keep the per-head layout. ``tests/callbacks/test_stacked_heads.py`` checks the steps
against torch autograd on separate heads.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from callbacks._utils.distributed import average_across_ranks_
from lightning_mods.evaluation._probe_head import ProbeHead
from lightning_mods.recipe.optim import adamw


class StackedHeads:
    """The heads ``heads`` (freshly built :class:`ProbeHead`\\ s of one width), stacked; after
    construction each head's tensors are views of the stack.

    Args:
        heads: the members, in order; their current values are the stack's start.
        optimizer: ``"adamw"`` or ``"sgd"``; ``lr``, ``momentum``: its settings (weight decay 0).
    """

    def __init__(self, heads: list[ProbeHead], optimizer: str, lr: float, momentum: float) -> None:
        self.heads = heads
        self.size = len(heads)
        first = heads[0]
        self.width, self.classes = first.linear.in_features, first.linear.out_features
        self.batch_norm = isinstance(first.norm, nn.BatchNorm1d)
        with torch.no_grad():
            self.weight = nn.Parameter(torch.stack([h.linear.weight.detach() for h in heads]))
            self.bias = nn.Parameter(torch.stack([h.linear.bias.detach() for h in heads]))
            if self.batch_norm:
                norms = [h.norm for h in heads]
                if any((n.momentum, n.eps) != (first.norm.momentum, first.norm.eps) for n in norms):
                    raise ValueError("StackedHeads: the heads' batch norms differ in momentum or eps")
                self.momentum, self.eps = first.norm.momentum, first.norm.eps
                self.running_mean = torch.stack([n.running_mean for n in norms])
                self.running_var = torch.stack([n.running_var for n in norms])
                self.batches_tracked = torch.stack([n.num_batches_tracked for n in norms])
        self._alias()
        params = [self.weight, self.bias]
        if optimizer == "adamw":
            self.optimizer: torch.optim.Optimizer = adamw(params, lr=lr, weight_decay=0.0)
        else:
            self.optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=0.0)
        self._pending: list[Optional[dict[str, Any]]] = [None] * self.size  # member states to load

    def _alias(self) -> None:
        """Point every member's tensors at its slice of the stack (and build the step's views)."""
        for i, head in enumerate(self.heads):
            head.linear.weight = nn.Parameter(self.weight.data[i])
            head.linear.bias = nn.Parameter(self.bias.data[i])
            if self.batch_norm:
                head.norm.running_mean = self.running_mean[i]
                head.norm.running_var = self.running_var[i]
                head.norm.num_batches_tracked = self.batches_tracked[i]
        self._weight_t = self.weight.detach().transpose(1, 2)  # H x D x C, follows the in-place updates
        self._bias_col = self.bias.detach().unsqueeze(1)  # H x 1 x C
        if self.batch_norm:
            self._mean_flat, self._var_flat = self.running_mean.view(-1), self.running_var.view(-1)

    def to(self, device: torch.device) -> "StackedHeads":
        with torch.no_grad():
            self.weight.data = self.weight.data.to(device)
            self.bias.data = self.bias.data.to(device)
            if self.batch_norm:
                self.running_mean, self.running_var = self.running_mean.to(device), self.running_var.to(device)
                self.batches_tracked = self.batches_tracked.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and (key != "step" or self._fused):  # a fused step counts on the device
                    state[key] = value.to(device)
        self._alias()
        return self

    @property
    def _fused(self) -> bool:
        return bool(self.optimizer.param_groups[0].get("fused"))

    # --- the step ---------------------------------------------------------------------------------
    def step(self, features: torch.Tensor, labels: torch.Tensor, onehot: torch.Tensor,
             scored: Optional[tuple[int, int]] = None) -> Optional[torch.Tensor]:
        """One optimiser step of every head on the mean cross-entropy of its own slice of
        ``features`` (``N x (H x D)``, member after member), ``onehot`` the labels' one-hot rows;
        gradients averaged over ranks. With ``scored = (member, k)``: that member's ``(loss x k,
        correct, k)`` over the first ``k`` samples, from the logits before the step."""
        self.apply_loaded_states()
        for head in self.heads:
            if not head.training:  # after a validation
                head.train()
        count = features.shape[0]
        sums = None
        with torch.no_grad():
            if self.batch_norm:
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.heads[0].norm.num_batches_tracked + 1)
                normed = F.batch_norm(features, self._mean_flat, self._var_flat, training=True,
                                      momentum=momentum, eps=self.eps)
                self.batches_tracked.add_(1)
            else:
                normed = features
            normed = normed.view(count, self.size, self.width).transpose(0, 1)  # H x N x D
            logits = torch.baddbmm(self._bias_col, normed, self._weight_t)  # H x N x C
            if scored is not None:
                member, k = scored
                chosen, chosen_labels = logits[member, :k], labels[:k]
                losses = -F.log_softmax(chosen, dim=1).gather(1, chosen_labels.view(-1, 1))
                sums = torch.stack([losses.double().sum(), (chosen.argmax(1) == chosen_labels).sum().double(),
                                    torch.full((), float(k), dtype=torch.float64, device=logits.device)])
            slope = torch.softmax(logits, dim=2).sub_(onehot).div_(count)
            self.weight.grad = torch.bmm(slope.transpose(1, 2), normed)
            self.bias.grad = slope.sum(1)
        average_across_ranks_((self.weight.grad, self.bias.grad))
        self.optimizer.step()
        if self.batch_norm:
            average_across_ranks_((self.running_mean, self.running_var))
        return sums

    # --- a member's optimiser state, in a per-head optimiser's layout ----------------------------
    def member_optimizer_state(self, member: int) -> dict[str, Any]:
        """The ``state_dict`` a separate optimiser of member ``member``'s head would have."""
        self.apply_loaded_states()
        view = self._member_from(self.optimizer.state_dict(), member)
        state = {index: {key: value.clone() if torch.is_tensor(value) else value for key, value in entry.items()}
                 for index, entry in view["state"].items()}
        return {"state": state, "param_groups": [dict(g) for g in view["param_groups"]]}

    def load_member_optimizer_state(self, member: int, state: dict[str, Any]) -> None:
        """A separate optimiser's ``state_dict`` for member ``member``, applied before the next step
        (once every member's is known, or with the others' current state)."""
        self._pending[member] = state

    def apply_loaded_states(self) -> None:
        """Load the member states given to :meth:`load_member_optimizer_state` into the optimiser."""
        if all(p is None for p in self._pending):
            return
        pending, self._pending = self._pending, [None] * self.size
        current = self.optimizer.state_dict()
        members = [p if p is not None else self._member_from(current, i) for i, p in enumerate(pending)]
        if any(not m["state"] for m in members):  # a member without any step yet: all start afresh
            if any(m["state"] for m in members):
                raise ValueError("StackedHeads: some heads have optimiser state and some have none")
            self.optimizer.param_groups[0].update({k: v for k, v in members[0]["param_groups"][0].items()
                                                   if k != "params"})
            return
        shapes = (self.weight.shape, self.bias.shape)
        state = {}
        for index in (0, 1):
            entries = [m["state"][index] for m in members]
            state[index] = {key: (torch.stack([torch.as_tensor(e[key]) for e in entries])
                                  if torch.is_tensor(value) and (len(entries),) + tuple(value.shape) == tuple(shapes[index])
                                  else value)
                            for key, value in entries[0].items()}
        groups = [{**members[0]["param_groups"][0], "params": [0, 1]}]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def _member_from(self, whole: dict[str, Any], member: int) -> dict[str, Any]:
        """Member ``member``'s slice of the stacked optimiser's ``state_dict`` ``whole`` (views)."""
        shapes = (self.weight.shape, self.bias.shape)
        return {"state": {index: {key: (value[member] if torch.is_tensor(value) and value.shape == shapes[index]
                                        else value) for key, value in entry.items()}
                          for index, entry in whole["state"].items()},
                "param_groups": whole["param_groups"]}
