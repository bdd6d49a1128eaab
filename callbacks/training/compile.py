"""``torch.compile`` as an option: compile the network's residual blocks in
place when a fit, validate or predict sets up.

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
