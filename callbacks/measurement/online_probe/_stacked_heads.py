"""Probe heads of one width and one learning rate held as one stacked set and stepped together.

The online probe trains a head on the final features and, with ``depth``, one per encoder
block: on the quickstart 13 small heads, each a batch norm without affine parameters and a
linear layer. Their tensors are stacked once by ``torch.func.stack_module_state`` (``H x C x D``
weights, ``H x C`` biases, ``H x D`` running statistics) and a step is the same few calls
whatever ``H``: torch's ``batch_norm`` over the ``N x (H x D)`` features (per head and channel,
the running statistics updated in the stacked buffers), one ``baddbmm`` for every head's logits,
each head's mean cross-entropy, its gradients from autograd, and one optimiser step (AdamW fused
where the kernel exists, else SGD with momentum) over the two stacked parameters: Adam and SGD
are elementwise, so each head's update is its own. (``torch.func.vmap`` of the heads' own forward
gives the same numbers with twice the operations a step, each a host-side dispatch on a GPU.)

Each member keeps its :class:`~lightning_mods.evaluation._probe_head.ProbeHead`, whose parameters
and buffers are views of the stacked tensors (what validation scores and ``state_dict`` read),
and its optimiser state can be read and written in the layout of a per-head optimiser, so
checkpoints keep the per-head layout. ``tests/callbacks/test_stacked_heads.py`` checks the steps
against separate heads stepped by torch autograd and their own optimisers.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import stack_module_state

from callbacks._utils.distributed import average_across_ranks_
from lightning_mods.evaluation._probe_head import ProbeHead
from lightning_mods.recipe.optim import adamw

WEIGHT, BIAS = "linear.weight", "linear.bias"
MEAN, VAR, TRACKED = "norm.running_mean", "norm.running_var", "norm.num_batches_tracked"


class StackedHeads:
    """The heads ``heads`` (freshly built :class:`ProbeHead`\\ s of one width), stacked; after
    construction each head's tensors are views of the stack.

    Args:
        heads: the members, in order; their current values are the stack's start.
        optimizer: ``"adamw"`` or ``"sgd"``; ``lr``, ``momentum``: its settings (weight decay 0).
    """

    def __init__(self, heads: list[ProbeHead], optimizer: str, lr: float, momentum: float) -> None:
        self.heads, self.size = heads, len(heads)
        self.width = heads[0].linear.in_features
        self.norm = heads[0].norm if isinstance(heads[0].norm, nn.BatchNorm1d) else None
        if self.norm is not None and any((h.norm.momentum, h.norm.eps) != (self.norm.momentum, self.norm.eps)
                                         for h in heads):
            raise ValueError("StackedHeads: the heads' batch norms differ in momentum or eps")
        params, self.buffers = stack_module_state(heads)
        self.weight, self.bias = (nn.Parameter(params[name].detach()) for name in (WEIGHT, BIAS))
        self._alias()
        if optimizer == "adamw":
            self.optimizer: torch.optim.Optimizer = adamw([self.weight, self.bias], lr=lr, weight_decay=0.0)
        else:
            self.optimizer = torch.optim.SGD([self.weight, self.bias], lr=lr, momentum=momentum, weight_decay=0.0)
        self._pending: list[Optional[dict[str, Any]]] = [None] * self.size  # member states to load

    def _alias(self) -> None:
        """Point every member's tensors at its slice of the stack."""
        for i, head in enumerate(self.heads):
            head.linear.weight = nn.Parameter(self.weight.data[i])
            head.linear.bias = nn.Parameter(self.bias.data[i])
            for name, value in self.buffers.items():
                setattr(head.norm, name.split(".")[-1], value[i])

    def to(self, device: torch.device) -> "StackedHeads":
        with torch.no_grad():
            for param in (self.weight, self.bias):
                param.data = param.data.to(device)
            self.buffers = {name: value.to(device) for name, value in self.buffers.items()}
        fused = bool(self.optimizer.param_groups[0].get("fused"))
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and (key != "step" or fused):  # a fused step counts on the device
                    state[key] = value.to(device)
        self._alias()
        return self

    # --- the step ---------------------------------------------------------------------------------
    def step(self, features: torch.Tensor, labels: torch.Tensor, target: torch.Tensor,
             scored: Optional[tuple[int, int]] = None) -> Optional[torch.Tensor]:
        """One optimiser step of every head on the mean cross-entropy of its own slice of
        ``features`` (``N x (H x D)``, member after member), ``target`` the labels' one-hot columns
        times ``-1 / N`` (:func:`mean_loss_target`); gradients averaged over ranks. With
        ``scored = (member, k)``: that member's ``(loss x k, correct, k)`` over the first ``k``
        samples, from the logits before the step."""
        self.apply_loaded_states()
        for head in self.heads:
            if not head.training:  # after a validation
                head.train()
        with torch.inference_mode(False), torch.enable_grad():  # the hooks may run under either
            # H x C x N, so that the weights' gradient comes dense (torch's fused CPU AdamW misreads a strided one)
            logits = torch.baddbmm(self.bias.unsqueeze(2), self.weight, self._normed(features))
            loss = (F.log_softmax(logits, dim=1) * target).sum()  # the heads' mean losses, summed
            self.weight.grad, self.bias.grad = torch.autograd.grad(loss, (self.weight, self.bias))
        sums = None
        if scored is not None:
            with torch.no_grad():
                member, k = scored
                chosen, chosen_labels = logits[member, :, :k].t(), labels[:k]
                loss = F.cross_entropy(chosen.double(), chosen_labels, reduction="sum")
                sums = torch.stack([loss, (chosen.argmax(1) == chosen_labels).sum().double(),
                                    torch.full((), float(k), dtype=torch.float64, device=logits.device)])
        average_across_ranks_((self.weight.grad, self.bias.grad))
        self.optimizer.step()
        average_across_ranks_((self.buffers[MEAN], self.buffers[VAR]) if self.norm is not None else ())
        return sums

    def _normed(self, features: torch.Tensor) -> torch.Tensor:
        """The features through every head's batch norm (training mode), ``H x D x N``."""
        if self.norm is not None:
            tracked = self.buffers[TRACKED]
            momentum = self.norm.momentum if self.norm.momentum is not None else 1.0 / float(tracked[0] + 1)
            features = F.batch_norm(features, self.buffers[MEAN].view(-1), self.buffers[VAR].view(-1),
                                    training=True, momentum=momentum, eps=self.norm.eps)
            tracked.add_(1)
        return features.view(len(features), self.size, self.width).permute(1, 2, 0)

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


def mean_loss_target(labels: torch.Tensor, classes: int, dtype: torch.dtype, batch: int) -> torch.Tensor:
    """The labels' one-hot columns (``classes x N``) times ``-1 / batch``: summed against the
    log-probabilities of a batch of ``batch`` of them, its mean cross-entropy (one call for all the
    batches of a sweep; ``F.one_hot`` would read the largest label back to the host)."""
    return torch.zeros(classes, len(labels), dtype=dtype, device=labels.device) \
        .scatter_(0, labels.view(1, -1), -1.0 / batch)
