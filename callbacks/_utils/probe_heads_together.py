"""Several probe heads of one width trained as one (the online probe's per-block heads).

With ``blocks`` the online probe trains a head per encoder block beside its own: on the
quickstart 12 small heads, each taking its own batch norm, linear gradient and optimiser step
4 times per probe: most of what the heads added to the probe's cost (the per-block probe went
from 5.9-6.3 % of a quickstart run to 4.8-4.9 % with this, ``python -m benchmarks --only
training``). Here the heads of one width and one rate take each step together, with the math
of :func:`callbacks._utils.online_probe_heads.step_head`:

- one ``batch_norm`` over the ``N x (heads x D)`` features (per-head, per-channel batch
  statistics, running statistics written back to each head's own buffers);
- one ``baddbmm`` for the logits, the cross-entropy's slope ``(softmax - onehot) / N`` and one
  ``bmm`` for the weight gradients;
- one optimiser step over every head's parameters (:class:`JointStep`), whose state stays each
  head's own optimiser's, so checkpoints keep their per-head layout.

Every head's result depends only on its own features: a head trained with others equals the
same head trained alone (``tests/callbacks/test_probe_heads_together.py`` checks this, and the steps against
torch autograd on separate ``ProbeHead``s).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lightning_mods.evaluation.probe_head import ProbeHead, cross_entropy_slope_

from callbacks._utils.distributed import average_across_ranks_


class JointStep:
    """Step single-group optimisers of one class and equal settings as one optimiser (one
    multi-tensor or fused call). Their state stays theirs: it is lent to the joint optimiser
    for the step and handed back after it, so a state loaded into one of them is used."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        groups = [opt.param_groups for opt in optimizers]
        if any(len(g) != 1 for g in groups) or len({type(opt) for opt in optimizers}) != 1:
            raise ValueError("JointStep: optimisers of one class with one parameter group each")
        settings = [{k: v for k, v in g[0].items() if k != "params"} for g in groups]
        if any(s != settings[0] for s in settings):
            raise ValueError("JointStep: the optimisers' settings differ")
        self.optimizers = list(optimizers)
        params = [p for g in groups for p in g[0]["params"]]
        self.joint = type(optimizers[0])(params, lr=settings[0]["lr"])
        self.joint.param_groups[0].update(settings[0])

    def step(self) -> None:
        state = self.joint.state
        state.clear()
        for opt in self.optimizers:
            state.update(opt.state)
        self.joint.step()
        for opt in self.optimizers:
            for p in opt.param_groups[0]["params"]:
                if p in state:
                    opt.state[p] = state[p]


def step_heads_together(heads: Sequence[ProbeHead], stepper: JointStep, features: Sequence[torch.Tensor],
                        labels: torch.Tensor) -> None:
    """One optimiser step of each head on the mean cross-entropy of its own ``features`` (each
    ``N x D``, one width), gradients averaged over ranks; the heads' optimisers are ``stepper``'s."""
    for head in heads:
        if not head.training:  # after a validation
            head.train()
    count, width = features[0].shape
    with torch.no_grad():
        stacked = torch.stack([f.detach() for f in features], dim=1).reshape(count, len(heads) * width)
        norms = [head.norm for head in heads]
        if isinstance(norms[0], torch.nn.BatchNorm1d):
            stacked = _batch_norm_together(norms, stacked)
        normed = stacked.view(count, len(heads), width).transpose(0, 1)  # heads x N x D
        weights = torch.stack([head.linear.weight for head in heads])  # heads x C x D
        biases = torch.stack([head.linear.bias for head in heads]).unsqueeze(1)  # heads x 1 x C
        logits = torch.baddbmm(biases, normed, weights.transpose(1, 2))
        slope = cross_entropy_slope_(F.log_softmax(logits, dim=2), labels)
        weight_grads = slope.transpose(1, 2).bmm(normed)
        bias_grads = slope.sum(1)
    for head, weight_grad, bias_grad in zip(heads, weight_grads, bias_grads):
        head.linear.weight.grad, head.linear.bias.grad = weight_grad, bias_grad
    average_across_ranks_(p.grad for head in heads for p in head.parameters())
    stepper.step()
    average_across_ranks_(b for head in heads for b in head.buffers() if b.is_floating_point())


def _batch_norm_together(norms: Sequence[torch.nn.BatchNorm1d], stacked: torch.Tensor) -> torch.Tensor:
    """``BatchNorm1d`` in training mode of each head on its slice of ``stacked`` (``N x (heads x
    D)``), as one ``batch_norm``; each head's running statistics updated as its own would be."""
    first = norms[0]
    if any((n.momentum, n.eps, n.track_running_stats) != (first.momentum, first.eps, first.track_running_stats)
           for n in norms):
        raise ValueError("step_heads_together: the heads' batch norms differ in momentum, eps or tracking")
    if not first.track_running_stats:
        return F.batch_norm(stacked, None, None, training=True, momentum=0.0, eps=first.eps)
    for norm in norms:
        norm.num_batches_tracked.add_(1)
    momentum = first.momentum if first.momentum is not None else 1.0 / float(first.num_batches_tracked)
    running_mean = torch.cat([n.running_mean for n in norms])
    running_var = torch.cat([n.running_var for n in norms])
    normed = F.batch_norm(stacked, running_mean, running_var, training=True, momentum=momentum, eps=first.eps)
    for norm, mean, var in zip(norms, running_mean.chunk(len(norms)), running_var.chunk(len(norms))):
        norm.running_mean.copy_(mean)
        norm.running_var.copy_(var)
    return normed
