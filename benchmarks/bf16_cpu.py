"""Ratio of a ViT-Tiny MAE-encoder train step in bf16 autocast vs fp32 on the CPU.

    .venv/bin/python benchmarks/bf16_cpu.py [--steps 5]

Prints one line per precision and the ratio, taken in one run (the number behind the CLI's
bf16-on-CPU warning). Run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import time

import torch

from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.vit import DecayedVisionTransformer


def step_time(model: torch.nn.Module, x: torch.Tensor, steps: int, bf16: bool) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x).float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = DecayedVisionTransformer(shortcut=ShortcutSchedule("linear", 0.6), img_size=224, patch_size=16,
                                     embed_dim=192, depth=12, num_heads=3, num_classes=0)
    x = torch.randn(args.batch, 3, 224, 224)
    fp32 = step_time(model, x, args.steps, bf16=False)
    bf16 = step_time(model, x, args.steps, bf16=True)
    print(f"threads={torch.get_num_threads()} batch={args.batch} ViT-Tiny/16 224px train step (median of {args.steps})")
    print(f"fp32      {fp32:.3f} s")
    print(f"bf16-auto {bf16:.3f} s")
    print(f"ratio bf16/fp32 = {bf16 / fp32:.1f}x")


if __name__ == "__main__":
    main()
