"""Probe a diffusion model's features over blocks x noise levels (the decay paper, section 5,
"Representations: linear probe on a chosen block's tokens at a chosen noise level; the paper
reports the best layer/noise pair").

    python -m commands.probe_diffusion --config runs/cifar100_uvit_s_alpha0.7/lightning_logs/version_0/config.yaml \\
        --ckpt runs/cifar100_uvit_s_alpha0.7/checkpoints/last.ckpt \\
        --blocks 0 3 6 9 12 --timesteps 0 25 50 100 200 400 --out runs/probe_alpha0.7

For every noise level ``t`` the train split (eval transform) and the held-out split are noised
to ``t`` (a fixed noise draw per batch) and the patch-token mean of every chosen block is kept;
then for every (block, t) a linear probe is trained on the frozen train features
(:func:`lightning_mods.linear_probe.train_linear_probe_on_features`) and a kNN vote
(:func:`callbacks.measurement.knn.knn_predict`, k=20, T=0.07) is scored on the held-out split.

Writes ``probe_results.csv``, ``probe_results.md`` (tables blocks x noise levels and the best
pair) and ``probe_heatmap_linear.png`` / ``probe_heatmap_knn.png`` into ``--out``.
Extra ``--section.key=value`` arguments override the config (e.g. ``--data.init_args.data_dir``).
"""
from __future__ import annotations

import argparse
import csv
import os
from typing import Optional, Sequence

import numpy as np
import torch
from rich.progress import Progress
from torch.utils.data import DataLoader, Dataset, Subset

from callbacks.measurement.knn import knn_predict
from commands._progress import command_progress, show_progress, tracked
from commands._renamed_options import renamed_options
from lightning_mods.pictures.grids import figure_to_array, save_png
from lightning_mods.checkpointing.rebuild import load_run
from lightning_mods.linear_probe import topk_accuracy, train_linear_probe_on_features
from lightning_mods._generation.fidelity_metrics import subset_indices

METRICS = ("linear_top1", "linear_top5", "knn_top1", "knn_top5")


@torch.no_grad()
def extract_block_features(module, loader: DataLoader, blocks: Sequence[int], timestep: int,  # noqa: ANN001
                           device: torch.device, seed: int = 0, progress: Optional[Progress] = None,
                           description: str = "features") -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """``{block: N x D}`` patch-token means at noise level ``timestep`` and the ``N`` labels
    (with ``progress``, a bar over the batches)."""
    feats: dict[int, list[torch.Tensor]] = {b: [] for b in blocks}
    labels = []
    for i, (images, targets) in enumerate(tracked(progress, loader, description)):
        pooled = module.noised_block_features(images.to(device), list(blocks), timestep, seed=seed + i)
        for b, f in zip(blocks, pooled):
            feats[b].append(f.float().cpu())
        labels.append(torch.as_tensor(targets).long())
    return {b: torch.cat(v) for b, v in feats.items()}, torch.cat(labels)


def probe_sweep(module, train_loader: DataLoader, val_loader: DataLoader, blocks: Sequence[int],  # noqa: ANN001
                timesteps: Sequence[int], num_classes: int, probe_epochs: int = 100, probe_lr: float = 1e-2,
                probe_batch_size: int = 1024, knn_k: int = 20, knn_temperature: float = 0.07,
                device: torch.device = torch.device("cpu"), progress: Optional[Progress] = None) -> list[dict]:
    """One row per (block, timestep) with the linear-probe and kNN accuracies (0..1); with
    ``progress``, a bar over the pairs and one over each feature pass."""
    rows = []
    pairs = None if progress is None else progress.add_task("probe (block, noise level) pairs",
                                                            total=len(blocks) * len(timesteps))
    for t in timesteps:
        train_feats, train_labels = extract_block_features(module, train_loader, blocks, t, device,
                                                           progress=progress, description=f"t={t}: train features")
        val_feats, val_labels = extract_block_features(module, val_loader, blocks, t, device, seed=10 ** 6,
                                                       progress=progress, description=f"t={t}: held-out features")
        for b in blocks:
            linear = train_linear_probe_on_features(train_feats[b], train_labels, val_feats[b], val_labels,
                                                    num_classes, epochs=probe_epochs, lr=probe_lr,
                                                    batch_size=probe_batch_size)
            scores = knn_predict(train_feats[b], train_labels, val_feats[b], num_classes, k=knn_k,
                                 temperature=knn_temperature)
            rows.append({"block": int(b), "timestep": int(t), "linear_top1": linear["top1"],
                         "linear_top5": linear["top5"], "knn_top1": topk_accuracy(scores, val_labels, 1),
                         "knn_top5": topk_accuracy(scores, val_labels, 5)})
            if progress is not None:
                progress.update(pairs, advance=1, description=f"probe (block, noise level) pairs: {b}, t={t} done")
    return rows


def best_pair(rows: list[dict], metric: str = "linear_top1") -> dict:
    """The row with the highest ``metric`` (the first such row on ties)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}; got {metric!r}")
    return max(rows, key=lambda r: r[metric])


def _grid(rows: list[dict], metric: str) -> tuple[list[int], list[int], np.ndarray]:
    blocks = sorted({r["block"] for r in rows})
    timesteps = sorted({r["timestep"] for r in rows})
    grid = np.full((len(blocks), len(timesteps)), np.nan)
    for r in rows:
        grid[blocks.index(r["block"]), timesteps.index(r["timestep"])] = r[metric]
    return blocks, timesteps, grid


def heatmap(rows: list[dict], metric: str, title: str) -> np.ndarray:
    """Blocks x noise levels picture of ``metric`` (percent) as an ``H x W x 3`` uint8 array."""
    from matplotlib.figure import Figure

    blocks, timesteps, grid = _grid(rows, metric)
    fig = Figure(figsize=(1.0 + 0.8 * len(timesteps), 1.0 + 0.45 * len(blocks)))
    ax = fig.add_subplot(1, 1, 1)
    image = ax.imshow(grid * 100.0, aspect="auto", cmap="viridis", origin="lower")
    ax.set_xticks(range(len(timesteps)), [str(t) for t in timesteps])
    ax.set_yticks(range(len(blocks)), [str(b) for b in blocks])
    ax.set_xlabel("noise level (timestep t)")
    ax.set_ylabel("block (in -> mid -> out)")
    ax.set_title(title)
    for i in range(len(blocks)):
        for j in range(len(timesteps)):
            ax.text(j, i, f"{grid[i, j] * 100:.1f}", ha="center", va="center", color="white", fontsize=7)
    fig.colorbar(image, ax=ax, label="accuracy (%)")
    fig.tight_layout()
    return figure_to_array(fig)


def markdown_table(rows: list[dict], metric: str) -> str:
    blocks, timesteps, grid = _grid(rows, metric)
    lines = ["| block \\ t | " + " | ".join(str(t) for t in timesteps) + " |",
             "|---" * (len(timesteps) + 1) + "|"]
    for i, b in enumerate(blocks):
        lines.append(f"| {b} | " + " | ".join(f"{v * 100:.2f}" for v in grid[i]) + " |")
    return "\n".join(lines)


def write_results(rows: list[dict], out_dir: str) -> dict[str, str]:
    """CSV, markdown and the two heatmaps; returns their paths by kind."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"csv": os.path.join(out_dir, "probe_results.csv"), "markdown": os.path.join(out_dir, "probe_results.md"),
             "heatmap_linear": os.path.join(out_dir, "probe_heatmap_linear.png"),
             "heatmap_knn": os.path.join(out_dir, "probe_heatmap_knn.png")}
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["block", "timestep", *METRICS])
        writer.writeheader()
        writer.writerows(rows)
    best_linear, best_knn = best_pair(rows, "linear_top1"), best_pair(rows, "knn_top1")
    with open(paths["markdown"], "w") as f:
        f.write("# Diffusion feature probe (accuracy %, held-out split)\n\n")
        f.write(f"Best linear probe: block {best_linear['block']}, t={best_linear['timestep']}: "
                f"top-1 {best_linear['linear_top1'] * 100:.2f}\n\n")
        f.write(f"Best kNN: block {best_knn['block']}, t={best_knn['timestep']}: "
                f"top-1 {best_knn['knn_top1'] * 100:.2f}\n\n")
        f.write("## Linear probe top-1\n\n" + markdown_table(rows, "linear_top1") + "\n\n")
        f.write("## kNN (k=20) top-1\n\n" + markdown_table(rows, "knn_top1") + "\n")
    save_png(heatmap(rows, "linear_top1", "linear probe top-1"), paths["heatmap_linear"])
    save_png(heatmap(rows, "knn_top1", "kNN top-1"), paths["heatmap_knn"])
    return paths


def subset_loader(dataset: Dataset, num: Optional[int], batch_size: int, num_workers: int, seed: int) -> DataLoader:
    indices = subset_indices(len(dataset), num, seed)
    data = dataset if indices is None else Subset(dataset, indices)
    return DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=num_workers)


def load_model_and_data(config: str, ckpt: Optional[str], overrides: Sequence[str] = (),  # noqa: ANN201
                        allow_override: bool = False):
    """Datamodule of a config and the model: with ``ckpt``, the network that wrote it (settings
    from its hyper-parameters, weights, EMA ones when trained with the EMA callback); a model
    setting of the config that disagrees with the checkpoint is a one-line error unless
    ``allow_override``. Without ``ckpt``, the config's untrained model."""
    from lightning.pytorch import LightningDataModule, LightningModule

    from commands.lightning_cli import LINKED_FROM_DATA, ShortcutLabCLI

    args = [f"--config={config}", "--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.devices=1",
            "--trainer.num_nodes=1", "--trainer.strategy=auto", "--trainer.accelerator=cpu", *overrides]
    built = ShortcutLabCLI(LightningModule, LightningDataModule, subclass_mode_model=True,
                           subclass_mode_data=True, run=False, args=args)
    module, datamodule = built.model, built.datamodule
    if ckpt is not None:
        given = built.config_dump["model"]
        settings = {k: v for k, v in (given.get("init_args") or {}).items()
                    if k not in LINKED_FROM_DATA and v is not None}
        module, _ = load_run(ckpt, {"class_path": given["class_path"], "init_args": settings}, allow_override,
                             with_data=False)  # the config's datamodule: its data settings are the ones given
    if not hasattr(module, "noised_block_features"):  # checked on the module returned, the checkpoint's too
        raise ValueError(f"config: the model {type(module).__name__} has no noised_block_features; "
                         "expected lightning_mods.diffusion.DiffusionModule")
    return module, datamodule


def main(args: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m commands.probe_diffusion",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the training config (model and data sections)")
    parser.add_argument("--ckpt", default=None, help="checkpoint of `shortcutlab fit`: the model is rebuilt from it "
                        "(default: the config's untrained model)")
    parser.add_argument("--allow-override", action="store_true",
                        help="build with the config's model settings where they disagree with the checkpoint")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--blocks", type=int, nargs="+", default=None, help="block indices (default: all)")
    parser.add_argument("--timesteps", type=int, nargs="+", default=[0, 25, 50, 100, 200, 400, 700])
    parser.add_argument("--max-train", type=int, default=None, help="train images used (fixed random subset)")
    parser.add_argument("--max-val", type=int, default=None, help="held-out images used")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-workers", type=int, default=None)
    parser.add_argument("--probe-epochs", type=int, default=100,
                        help="linear-probe epochs per (block, noise level) pair; the decay paper's linear-probe protocol uses 200 "
                             "for one probe, a sweep trains one per pair")
    parser.add_argument("--probe-lr", type=float, default=1e-2)
    parser.add_argument("--probe-batch-size", type=int, default=1024)
    parser.add_argument("--knn-k", type=int, default=20)
    parser.add_argument("--knn-temperature", type=float, default=0.07)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars (also off when stderr is not a terminal)")
    args = renamed_options(args, {"--allow-model-override": "--allow-override"}, "probe_diffusion")
    parsed, overrides = parser.parse_known_args(args)

    module, datamodule = load_model_and_data(parsed.config, parsed.ckpt, overrides, parsed.allow_override)
    num_blocks = module.network.num_blocks
    blocks = list(range(num_blocks)) if parsed.blocks is None else parsed.blocks
    bad = [b for b in blocks if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"--blocks must be in [0, {num_blocks - 1}], got {bad}")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if parsed.device == "auto" else parsed.device)
    datamodule.setup("fit")
    module.set_pixel_stats(datamodule)
    module.to(device).eval()
    workers = datamodule.num_workers if parsed.num_workers is None else parsed.num_workers
    train_loader = subset_loader(datamodule.bank_dataset, parsed.max_train, parsed.batch_size, workers, seed=0)
    val_loader = subset_loader(datamodule.val_dataset, parsed.max_val, parsed.batch_size, workers, seed=1)
    with command_progress(show_progress(parsed.quiet)) as progress:
        rows = probe_sweep(module, train_loader, val_loader, blocks, parsed.timesteps, int(datamodule.num_classes),
                           probe_epochs=parsed.probe_epochs, probe_lr=parsed.probe_lr,
                           probe_batch_size=parsed.probe_batch_size, knn_k=parsed.knn_k,
                           knn_temperature=parsed.knn_temperature, device=device, progress=progress)
    paths = write_results(rows, parsed.out)
    best = best_pair(rows, "linear_top1")
    print(f"best linear probe: block {best['block']}, t={best['timestep']}, top-1 {best['linear_top1'] * 100:.2f}%; "
          f"kNN top-1 there {best['knn_top1'] * 100:.2f}%; table: {paths['markdown']}")
    return rows


if __name__ == "__main__":
    main()
