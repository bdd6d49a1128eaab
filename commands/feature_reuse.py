"""The ResidualDroppath paper's feature-reuse pictures (SPEC section 5; "ResidualDroppath",
section 3.1, figures 1, 3 and 4).

    python -m commands.feature_reuse --depth 6 --width 6 --epochs 1000 --out runs/reuse [--residual-droppath]

trains the residual MLP (:mod:`lightning_mods.backbone.residual_mlp`) on the spiral
(:mod:`datamodules.spiral`) with Adam, lr 0.1, batch 256, optionally with the
ResidualDroppath callback, and writes two PNGs into ``--out``:

- ``<variant>_node_outputs.png``: ``H`` rows (nodes; above ``--max-nodes`` the two input-coordinate
  nodes and evenly spaced others)
  by ``2N + 1`` columns for ``N`` layers: the input coordinates, then for each layer the
  weights into it (a line from node ``i`` to node ``j`` per weight ``W[j, i]``; blue positive,
  orange negative, width proportional to ``|W[j, i]|`` over the layer's largest) and the
  contour plot of every node's output over the grid (50 x 50 over ``[-1, 1]^2``, colours
  symmetric around 0 per node). The last column also shows 400 training points.
  Each cell is ``--cell-pixels`` square.
- ``<variant>_feature_similarity.png`` (600 x 500 pixels): the layer-by-layer heatmap over
  the grid of ``[input, layer 1, ..., layer N]``. ``euclidean`` (default, the paper's):
  mean over grid points of ``||h_i(p) - h_j(p)||_2``, comparable because every layer lives in
  the same node space (residual stream); ``cka``: linear CKA of the centred feature matrices.

``<variant>`` is ``standard`` or ``residual_droppath``.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal, Optional, Sequence

import lightning as L
import numpy as np
import torch
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from matplotlib.gridspec import GridSpec

from lightning_mods.pictures import figure_to_array, save_png
from lightning_mods import metric_names
from callbacks.residual_droppath import ResidualDroppath
from datamodules.spiral import Spiral, grid_points
from lightning_mods.backbone.residual_mlp import ResidualMLP
from lightning_mods.spiral_classifier import SpiralClassifier

Similarity = Literal["euclidean", "cka"]
SIMILARITY_FIGSIZE = (6.0, 5.0)  # inches at 100 dpi: 600 x 500 pixels
POSITIVE, NEGATIVE = "#1f77b4", "#ff7f0e"


def sample_nodes(width: int, max_nodes: int, first: int = 2) -> list[int]:
    """All nodes when ``width <= max_nodes``; else nodes ``0 .. first-1`` (the input coordinates)
    and evenly spaced others, ``max_nodes`` in all, the last node included."""
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    if width <= max_nodes:
        return list(range(width))
    head = list(range(min(first, max_nodes)))
    rest = max_nodes - len(head)
    if rest == 0:
        return head
    tail = np.linspace(len(head), width - 1, rest).round().astype(int).tolist()
    return head + sorted(set(tail))


@torch.no_grad()
def layer_outputs(net: ResidualMLP, points: torch.Tensor) -> list[np.ndarray]:
    """``[embedded input, layer 1, ..., layer N]`` outputs at ``points``, each ``P x width`` float64."""
    was_training = net.training
    net.eval()
    try:
        device = next(net.parameters()).device
        outputs = net.forward_layers(points.to(device))
    finally:
        net.train(was_training)
    return [o.double().cpu().numpy() for o in outputs]


def pairwise_euclidean(features: Sequence[np.ndarray]) -> np.ndarray:
    """``D[i, j]``: mean over points of the Euclidean distance between ``features[i]`` and ``[j]``."""
    n = len(features)
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            out[i, j] = np.linalg.norm(features[i] - features[j], axis=1).mean()
    return out


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA of two ``P x D`` feature matrices (0 when either is constant)."""
    x = x - x.mean(axis=0, keepdims=True)
    y = y - y.mean(axis=0, keepdims=True)
    denom = np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)
    return float(np.linalg.norm(y.T @ x) ** 2 / denom) if denom > 0 else 0.0


def pairwise_cka(features: Sequence[np.ndarray]) -> np.ndarray:
    """``C[i, j]``: linear CKA between ``features[i]`` and ``features[j]``."""
    n = len(features)
    return np.array([[linear_cka(features[i], features[j]) for j in range(n)] for i in range(n)])


def similarity_matrix(features: Sequence[np.ndarray], metric: Similarity) -> np.ndarray:
    if metric == "euclidean":
        return pairwise_euclidean(features)
    if metric == "cka":
        return pairwise_cka(features)
    raise ValueError(f"similarity must be 'euclidean' or 'cka', got {metric!r}")


def _contour(ax, values: np.ndarray, grid_size: int, extent: float = 1.0) -> None:
    xs = np.linspace(-extent, extent, grid_size)
    z = values.reshape(grid_size, grid_size)  # row = y index, column = x index (datamodules.spiral)
    v = max(float(np.abs(z).max()), 1e-6)
    ax.contourf(xs, xs, z, levels=np.linspace(-v, v, 13), cmap="RdBu_r")


def _weight_lines(ax, weight: np.ndarray, sources: list[tuple[int, int]], targets: list[int], rows: int) -> None:
    """A line from each ``(row, node i)`` of ``sources`` (x = 0) to each target node ``j``'s row (x = 1)
    for ``weight[j, i]``: colour = sign, width = magnitude over the largest one drawn."""
    ax.set_xlim(0, 1)
    ax.set_ylim(0, rows)
    ax.axis("off")
    pairs = [(r_in, i, r_out, j) for r_out, j in enumerate(targets) for r_in, i in sources]
    scale = max(max((abs(float(weight[j, i])) for _, i, _, j in pairs), default=0.0), 1e-12)
    segments = [[(0.0, rows - r_in - 0.5), (1.0, rows - r_out - 0.5)] for r_in, _, r_out, _ in pairs]
    colours = [POSITIVE if weight[j, i] >= 0 else NEGATIVE for _, i, _, j in pairs]
    widths = [0.2 + 2.8 * abs(float(weight[j, i])) / scale for _, i, _, j in pairs]
    ax.add_collection(LineCollection(segments, colors=colours, linewidths=widths))


def node_outputs_figure(outputs: Sequence[np.ndarray], weights: Sequence[np.ndarray], nodes: list[int],
                        grid_size: int, in_features: int = 2, train_points: Optional[np.ndarray] = None,
                        train_labels: Optional[np.ndarray] = None, cell_pixels: int = 64) -> Figure:
    """``len(nodes)`` rows x ``2N + 1`` columns of ``cell_pixels``-square cells (see module docstring).

    ``outputs`` are ``[input, layer 1, ..., layer N]`` over the grid (``grid_size^2 x width``),
    ``weights[l]`` the ``width x width`` matrix into layer ``l + 1``.
    """
    depth = len(outputs) - 1
    if len(weights) != depth:
        raise ValueError(f"weights must have one matrix per layer ({depth}), got {len(weights)}")
    rows, cols = len(nodes), 2 * depth + 1
    fig = Figure(figsize=(cols, rows), dpi=cell_pixels)  # 1 inch per cell at cell_pixels dpi
    grid = GridSpec(rows, cols, figure=fig, left=0, right=1, bottom=0, top=1, wspace=0.08, hspace=0.08)
    for col in range(0, cols, 2):
        layer = col // 2
        for r, node in enumerate(nodes):
            ax = fig.add_subplot(grid[r, col])
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0 and node >= in_features:
                ax.axis("off")  # zero padding of the 2-D input
                continue
            _contour(ax, outputs[layer][:, node], grid_size)
            if layer == depth and train_points is not None and train_labels is not None:
                ax.scatter(train_points[:, 0], train_points[:, 1], c=np.where(train_labels == 0, POSITIVE, NEGATIVE),
                           s=0.4, linewidths=0)
                ax.set_xlim(-1, 1)
                ax.set_ylim(-1, 1)
    for layer in range(1, depth + 1):
        ax = fig.add_subplot(grid[:, 2 * layer - 1])
        # into layer 1 only the input rows holding a coordinate carry weight (the rest are zeros)
        sources = [(r, n) for r, n in enumerate(nodes) if layer > 1 or n < in_features]
        _weight_lines(ax, weights[layer - 1], sources, nodes, rows)
    return fig


def similarity_figure(matrix: np.ndarray, metric: Similarity) -> Figure:
    """Heatmap of a ``(N + 1) x (N + 1)`` layer similarity matrix (index 0 = input), 600 x 500 px."""
    fig = Figure(figsize=SIMILARITY_FIGSIZE, dpi=100)
    ax = fig.add_axes((0.12, 0.12, 0.68, 0.78))
    cax = fig.add_axes((0.84, 0.12, 0.04, 0.78))
    image = ax.imshow(matrix, cmap="viridis_r" if metric == "euclidean" else "viridis", origin="upper")
    fig.colorbar(image, cax=cax)
    ax.set_xlabel("layer (0 = input)")
    ax.set_ylabel("layer (0 = input)")
    ax.set_title("mean Euclidean distance" if metric == "euclidean" else "linear CKA")
    return fig


def draw_pictures(net: ResidualMLP, out_dir: str | Path, variant: str, grid_size: int = 50, max_nodes: int = 8,
                  similarity: Similarity = "euclidean", train_points: Optional[np.ndarray] = None,
                  train_labels: Optional[np.ndarray] = None, cell_pixels: int = 64) -> dict[str, Path]:
    """Write ``<variant>_node_outputs.png`` and ``<variant>_feature_similarity.png`` into ``out_dir``."""
    outputs = layer_outputs(net, grid_points(grid_size))
    weights = [layer.fc.weight.detach().double().cpu().numpy() for layer in net.layers]
    nodes = sample_nodes(net.width, max_nodes, net.in_features)
    out_dir = Path(out_dir)
    node_fig = node_outputs_figure(outputs, weights, nodes, grid_size, net.in_features, train_points,
                                   train_labels, cell_pixels)
    sim_fig = similarity_figure(similarity_matrix(outputs, similarity), similarity)
    return {
        "node_outputs": save_png(figure_to_array(node_fig, dpi=cell_pixels), out_dir / f"{variant}_node_outputs.png"),
        "feature_similarity": save_png(figure_to_array(sim_fig, dpi=100),
                                       out_dir / f"{variant}_feature_similarity.png"),
    }


def train_on_spiral(depth: int, width: int, epochs: int, residual_droppath: bool = False, drop_rate: float = 0.1,
                    seed: int = 0, num_points: int = 16384, batch_size: int = 256, lr: float = 0.1,
                    accelerator: str = "cpu", out_dir: str | Path = ".") -> tuple[SpiralClassifier, Spiral, dict]:
    """Fit :class:`SpiralClassifier` on :class:`Spiral`; returns the model, the data and test metrics."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    L.seed_everything(seed, verbose=False)
    data = Spiral(num_points=num_points, batch_size=batch_size, seed=seed)
    model = SpiralClassifier(depth=depth, width=width, lr=lr)
    callbacks = [ResidualDroppath(drop_rate=drop_rate, seed=seed)] if residual_droppath else []
    trainer = L.Trainer(max_epochs=epochs, accelerator=accelerator, devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, default_root_dir=str(out_dir), num_sanity_val_steps=0,
                        check_val_every_n_epoch=max(1, epochs))
    trainer.fit(model, datamodule=data)
    metrics = trainer.test(model, datamodule=data, verbose=False)[0]
    return model, data, metrics


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m commands.feature_reuse",
                                     description="Train the residual MLP on the spiral, draw the "
                                                 "feature-reuse pictures (ResidualDroppath paper, 3.1).")
    parser.add_argument("--depth", type=int, default=6, help="residual layers (paper: 6 or 32)")
    parser.add_argument("--width", type=int, default=6, help="nodes per layer (paper: 6 or 32)")
    parser.add_argument("--epochs", type=int, default=1000, help="training epochs (paper: 1000)")
    parser.add_argument("--out", required=True, help="folder for the PNGs")
    parser.add_argument("--residual-droppath", action="store_true", help="train with the ResidualDroppath callback")
    parser.add_argument("--drop-rate", type=float, default=0.1, help="ResidualDroppath drop rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-points", type=int, default=16384, help="spiral training points")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.1, help="Adam learning rate")
    parser.add_argument("--max-nodes", type=int, default=8, help="rows of the node picture (nodes sampled)")
    parser.add_argument("--similarity", choices=("euclidean", "cka"), default="euclidean")
    parser.add_argument("--cell-pixels", type=int, default=64, help="side of one cell of the node picture")
    parser.add_argument("--accelerator", default="cpu")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Path]:
    """Train, draw, print where the pictures went; returns their paths."""
    args = parse_args(argv)
    if args.cell_pixels < 8:
        raise ValueError(f"cell_pixels must be >= 8, got {args.cell_pixels}")
    model, data, metrics = train_on_spiral(args.depth, args.width, args.epochs, args.residual_droppath,
                                           args.drop_rate, args.seed, args.num_points, args.batch_size, args.lr,
                                           args.accelerator, args.out)
    points, labels = data.train_dataset.tensors
    show = torch.randperm(len(labels), generator=torch.Generator().manual_seed(args.seed))[:400]
    variant = "residual_droppath" if args.residual_droppath else "standard"
    paths = draw_pictures(model.net, args.out, variant, data.grid_size, args.max_nodes, args.similarity,
                          points[show].numpy(), labels[show].numpy(), args.cell_pixels)
    print(f"grid accuracy (nearest-arm labels): {metrics[metric_names.TEST_TOP1]:.4f}")
    for name, path in paths.items():
        print(f"{name}: {path}")
    return paths


if __name__ == "__main__":
    main()
