"""Evaluation without side effects on training: the context every evaluation of a training
module runs in (kNN, effective rank, online probe, sample grids)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def module_device(module: nn.Module) -> torch.device:
    """Where the module's parameters (or buffers) live; CPU for a module with neither."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


@contextlib.contextmanager
def isolated_eval(module: nn.Module) -> Iterator[None]:
    """Run ``module`` for evaluation without side effects on training.

    Inside: every sub-module in eval mode (no batch-norm statistics updates, no dropout),
    ``torch.no_grad``, and forked CPU / current-device RNG states (a draw inside, e.g. by a
    DataLoader iterator, does not shift the training run's masks and shuffles). On exit every
    sub-module gets back its own previous mode (frozen parts stay in eval).

    The flags are set on each sub-module directly, in one pass over the list of sub-modules
    (``Module.train`` recurses and goes through ``Module.__setattr__``: 22 % of the quickstart
    probe's time in its training hook); a tree with a sub-module that overrides ``train`` gets
    ``module.eval()`` itself on entry. The restore sets every flag back, one by one: calling
    ``m.train(mode)`` per sub-module would recurse into every subtree again.
    """
    modules = submodules(module)
    modes = [vars(m)["training"] for m in modules]
    device = module_device(module)
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices), torch.no_grad():
            if all(kind.train is nn.Module.train for kind in {type(m) for m in modules}):
                for m in modules:  # what module.eval() does, without its recursion and __setattr__
                    vars(m)["training"] = False
            else:  # a module with its own train(): it may do more than set the flag
                module.eval()
            yield
    finally:
        for m, training in zip(modules, modes):
            vars(m)["training"] = training


def submodules(module: nn.Module) -> list[nn.Module]:
    """``list(module.modules())`` (the same modules, each once, in the same order), in half its
    time: no names are built. Runs at every online-probe step."""
    found, seen, stack = [], set(), [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        found.append(m)
        stack.extend(child for child in reversed(m._modules.values()) if child is not None)
    return found
