"""``torch.compile`` as an option, in two scopes, each compiled in place when a fit, validate or
predict sets up: :class:`CompileBlocks` (the residual blocks) and :class:`CompileNetwork` (the
module's whole call, captured as CUDA graphs on a GPU).

Each shortcut-aware block (``lightning_mods.backbone.residual.residual_blocks``: the ViT, U-ViT
and ResNet blocks, the MAE decoder's) is compiled with ``nn.Module.compile``, which compiles the
module's call in place: parameter names and the ``state_dict`` stay as they were (no
``_orig_mod.`` prefix), so a checkpoint written by a compiled run loads into an eager network
and the other way round. The blocks hold nearly all the FLOPs; the code around them (masking,
patch embedding, heads, the evaluation hooks) stays eager, where a graph break would cost more
than it gains. A ``branch_hook`` (ResidualDroppath) is traced with the block.

On the 2-core development CPU a compiled ViT-Tiny step took 0.95x the eager time after a 38 s
cold compile (``python -m benchmarks --only models --compile``, the whole backbone compiled);
on a GPU inductor fuses the elementwise work around attention and the MLP. Results equal eager
within float32 rounding, not bit for bit.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_mods.backbone.residual import residual_blocks
from callbacks.cost import ONCE


class CompileBlocks(Callback):
    """Compile every residual block of the LightningModule in place (see the module docstring).

    Args:
        backend: ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` to check tracing
            without code generation).
        mode: inductor mode (``None``, ``"reduce-overhead"``, ``"max-autotune"``).
        fullgraph: fail on a graph break instead of splitting the graph.
        dynamic: ``torch.compile``'s ``dynamic`` (``None``: decide from recompilations).
    """
    cost = ONCE

    def __init__(self, backend: str = "inductor", mode: Optional[str] = None, fullgraph: bool = False,
                 dynamic: Optional[bool] = None) -> None:
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"CompileBlocks: backend must be a backend name, got {backend!r}")
        self.backend, self.mode, self.fullgraph, self.dynamic = backend, mode, fullgraph, dynamic

    @property
    def state_key(self) -> str:
        return self._generate_state_key(backend=self.backend, mode=self.mode)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if getattr(pl_module, "_compiled_call_impl", None) is not None:
            raise ValueError(f"CompileBlocks: {type(pl_module).__name__} is compiled whole already (CompileNetwork?); "
                             "compile the network or its blocks, not both")
        blocks = residual_blocks(pl_module)
        if not blocks:
            raise ValueError(f"CompileBlocks: {type(pl_module).__name__} has no residual blocks to compile "
                             "(lightning_mods.backbone.residual.DecayedResidual)")
        options: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode is not None:
            options["mode"] = self.mode
        for block in blocks:
            if getattr(block, "_compiled_call_impl", None) is None:  # once, whatever the stages
                block.compile(**options)


class CompileNetwork(Callback):
    """Compile the LightningModule's whole call in place, as a step the host cannot slow down.

    Everything a training step runs through ``self(...)`` is one compiled graph, forward and
    backward: the MAE's masking, encoder, decoder and loss; the U-ViT's network; a classifier's
    backbone and head. With ``mode="reduce-overhead"`` (the default) inductor replays that graph
    as CUDA graphs on a GPU: one launch where an eager step launches thousands of kernels, so
    loader workers and callbacks sharing the host no longer slow it. On the CPU the same mode
    runs inductor's code without graphs. The optimiser stays outside, fused AdamW. Under DDP,
    Lightning routes ``training_step`` itself through the module's call, so the compiled code
    holds the step too, split into graphs where it logs.

    The compile is in place (``nn.Module.compile``): parameter names and the ``state_dict`` are
    unchanged, so checkpoints of compiled and eager runs are interchangeable. With
    ``eager_random`` (the default) random draws inside the graph (the MAE's masks, dropout) call
    the same generator as eager code, so a compiled run draws the masks an eager run draws, and a
    run resumed with or without it goes on with the same draws. Evaluation hooks that call ``forward_features``
    (kNN, the online probe, effective rank) stay eager. The first steps compile (tens of seconds
    on a GPU, more on a CPU), and each new input shape compiles again (the last, shorter batch of
    an epoch unless the loader drops it, a validation batch). Do not combine it with
    :class:`CompileBlocks`.

    Args:
        backend: ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` to check tracing
            without code generation).
        mode: inductor mode: ``"reduce-overhead"`` (CUDA graphs), ``None``, ``"max-autotune"``.
        fullgraph: fail on a graph break instead of splitting the graph.
        dynamic: ``torch.compile``'s ``dynamic``. Default ``False``: a graph per input shape, as
            CUDA graphs need (``None`` turns a second shape into a symbolic batch size, which
            torch 2.14 cannot trace through the MAE's ``torch.rand(..., generator=...)``).
        eager_random: inductor draws random numbers as eager code does (its ``fallback_random``).
    """
    cost = ONCE

    def __init__(self, backend: str = "inductor", mode: Optional[str] = "reduce-overhead", fullgraph: bool = False,
                 dynamic: Optional[bool] = False, eager_random: bool = True) -> None:
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"CompileNetwork: backend must be a backend name, got {backend!r}")
        if mode is not None:
            from lightning_mods._compat.library_private import inductor_mode_options
            try:
                inductor_mode_options(mode)
            except Exception as err:  # noqa: BLE001 (torch's message names the modes)
                raise ValueError(f"CompileNetwork: mode {mode!r} is not an inductor mode ({err})") from None
        self.backend, self.mode, self.fullgraph, self.dynamic = backend, mode, fullgraph, dynamic
        self.eager_random = bool(eager_random)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(backend=self.backend, mode=self.mode)

    def compile_options(self) -> dict[str, Any]:
        """The keyword arguments of ``torch.compile``: inductor's options of ``mode``, plus
        ``fallback_random`` under ``eager_random`` (torch takes a mode or options, not both)."""
        options: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.backend != "inductor":
            return options  # modes and options are inductor's
        if not self.eager_random:
            return {**options, **({"mode": self.mode} if self.mode is not None else {})}
        from lightning_mods._compat.library_private import inductor_mode_options
        mode_options = inductor_mode_options(self.mode) if self.mode is not None else {}  # None: every mode's
        return {**options, "options": {**mode_options, "fallback_random": True}}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        compiled = [name for name, module in pl_module.named_modules()
                    if module is not pl_module and getattr(module, "_compiled_call_impl", None) is not None]
        if compiled:
            raise ValueError(f"CompileNetwork: {type(pl_module).__name__}.{compiled[0]} is compiled already "
                             "(CompileBlocks?); compile the network or its blocks, not both")
        if getattr(pl_module, "_compiled_call_impl", None) is None:  # once, whatever the stages
            pl_module.compile(**self.compile_options())
