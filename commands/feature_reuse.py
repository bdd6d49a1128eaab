"""The ResidualDroppath paper's feature-reuse pictures (the ResidualDroppath paper, section 3; "ResidualDroppath",
section 3.1, figures 1, 3 and 4).

    python -m commands.feature_reuse --depth 6 --width 6 --epochs 1000 --out runs/reuse [--residual-droppath]

trains the residual MLP (:mod:`lightning_mods.backbone.residual_mlp`) on the spiral
(:mod:`datamodules.spiral`) with Adam, lr 0.1, batch 256, optionally with the
ResidualDroppath callback (a progress bar over the epochs on a terminal; ``--quiet``: none),
and writes two titled PNGs into ``--out``:

- ``<variant>_node_outputs.png``: ``H`` rows (nodes; above ``--max-nodes`` the two input-coordinate
  nodes and evenly spaced others)
  by ``2N + 1`` columns for ``N`` layers: the input coordinates, then for each layer the
  weights into it (a line from node ``i`` to node ``j`` per weight ``W[j, i]``; blue positive,
  orange negative, width proportional to ``|W[j, i]|`` over the layer's largest) and the
  contour plot of every node's output over the grid (50 x 50 over ``[-1, 1]^2``, colours
  symmetric around 0 per node). The last column also shows 400 training points.
  Each cell is ``--cell-pixels`` square; around the cells the title, the column (input, W_l,
  layer l) and row (node) labels, a colour bar in units of each panel's largest output and a
  legend of the weight lines and training points (:data:`NODE_MARGINS`).
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
from rich.progress import Progress

from lightning_mods.evaluation import metric_names
from callbacks.training.residual_droppath import ResidualDroppath
from commands._progress import EpochProgress, command_progress, show_progress
from datamodules.spiral import Spiral, grid_points
from lightning_mods.backbone.residual_mlp import ResidualMLP
from lightning_mods.pictures.grids import figure_to_array, save_png
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


NODE_MARGINS = {"left": 110, "right": 120, "top": 80, "bottom": 90}  # pixels around the node cells
NODE_MIN_WIDTH = 620  # pixels: room for the title and the legend however few the cells


def node_outputs_figure(outputs: Sequence[np.ndarray], weights: Sequence[np.ndarray], nodes: list[int],
                        grid_size: int, in_features: int = 2, train_points: Optional[np.ndarray] = None,
                        train_labels: Optional[np.ndarray] = None, cell_pixels: int = 64,
                        title: str = "node outputs of the residual MLP", dpi: int = 100) -> Figure:
    """``len(nodes)`` rows x ``2N + 1`` columns of ``cell_pixels``-square cells (see module docstring),
    inside :data:`NODE_MARGINS` holding the title, column and row labels, the colour bar of the node
    outputs and the legend of the weight lines and training points.

    ``outputs`` are ``[input, layer 1, ..., layer N]`` over the grid (``grid_size^2 x width``),
    ``weights[l]`` the ``width x width`` matrix into layer ``l + 1``.
    """
    depth = len(outputs) - 1
    if len(weights) != depth:
        raise ValueError(f"weights must have one matrix per layer ({depth}), got {len(weights)}")
    rows, cols = len(nodes), 2 * depth + 1
    m = NODE_MARGINS
    width = max(m["left"] + cols * cell_pixels + m["right"], NODE_MIN_WIDTH)
    height = m["top"] + rows * cell_pixels + m["bottom"]
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    left, right = m["left"] / width, (m["left"] + cols * cell_pixels) / width
    bottom, top = m["bottom"] / height, (m["bottom"] + rows * cell_pixels) / height
    grid = GridSpec(rows, cols, figure=fig, left=left, right=right, bottom=bottom, top=top, wspace=0.08, hspace=0.08)
    small = cell_pixels < 48  # short labels that fit above and beside small cells
    label_size = 6 if small else 8
    for col in range(0, cols, 2):
        layer = col // 2
        for r, node in enumerate(nodes):
            ax = fig.add_subplot(grid[r, col])
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                heading = ("in" if small else "input") if layer == 0 else (f"L{layer}" if small else f"layer {layer}")
                ax.set_title(heading, fontsize=label_size)
            if col == 0:
                name = f"node {node}" + (f"\n(input x{node + 1})" if node < in_features and not small else "")
                ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=label_size)
            if layer == 0 and node >= in_features:
                for spine in ax.spines.values():
                    spine.set_visible(False)  # zero padding of the 2-D input: nothing to draw
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
        ax.set_title(f"W{layer}", fontsize=label_size)
    fig.suptitle(title, y=1 - 8 / height, va="top", fontsize=10)
    _node_figure_keys(fig, width, height, right, bottom, top)
    return fig


def _node_figure_keys(fig: Figure, width: float, height: float, right: float, bottom: float, top: float) -> None:
    """The colour bar, the legend and the caption of :func:`node_outputs_figure`."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.lines import Line2D

    # every contour is scaled to its own largest |output|: one colour bar in those units serves all
    cax = fig.add_axes((right + 30 / width, bottom, 12 / width, top - bottom))
    bar = fig.colorbar(ScalarMappable(Normalize(-1, 1), cmap="RdBu_r"), cax=cax)
    bar.set_label("node output / its max |output|\n(per panel)", fontsize=7)
    bar.ax.tick_params(labelsize=7)
    handles = [Line2D([], [], color=POSITIVE, lw=2, label="positive weight (width: |W|)"),
               Line2D([], [], color=NEGATIVE, lw=2, label="negative weight"),
               Line2D([], [], color=POSITIVE, marker="o", lw=0, markersize=4, label="class 0 training points"),
               Line2D([], [], color=NEGATIVE, marker="o", lw=0, markersize=4, label="class 1 training points")]
    fig.legend(handles=handles, loc="lower left", bbox_to_anchor=(8 / width, 22 / height), ncol=2, fontsize=7,
               frameon=False)
    fig.text(8 / width, 6 / height, "each panel: a node's output over the input square [-1, 1]^2 "
             "(x1 horizontal, x2 vertical); W_l: the weights into layer l (L_l)", fontsize=7)


def similarity_figure(matrix: np.ndarray, metric: Similarity, title: str = "") -> Figure:
    """Heatmap of a ``(N + 1) x (N + 1)`` layer similarity matrix (index 0 = input), 600 x 500 px."""
    fig = Figure(figsize=SIMILARITY_FIGSIZE, dpi=100)
    ax = fig.add_axes((0.12, 0.12, 0.66, 0.74))
    cax = fig.add_axes((0.82, 0.12, 0.04, 0.74))
    image = ax.imshow(matrix, cmap="viridis_r" if metric == "euclidean" else "viridis", origin="upper")
    measure = "mean Euclidean distance ||h_i - h_j||" if metric == "euclidean" else "linear CKA"
    fig.colorbar(image, cax=cax).set_label(measure + " (bright: similar)")  # viridis_r for distances
    ticks = range(len(matrix))
    ax.set_xticks(ticks, ["in" if i == 0 else str(i) for i in ticks])
    ax.set_yticks(ticks, ["in" if i == 0 else str(i) for i in ticks])
    ax.set_xlabel("layer j (in = input)")
    ax.set_ylabel("layer i (in = input)")
    ax.set_title((title + "\n" if title else "") + f"layer-to-layer feature similarity: {measure}", fontsize=10)
    return fig


def draw_pictures(net: ResidualMLP, out_dir: str | Path, variant: str, grid_size: int = 50, max_nodes: int = 8,
                  similarity: Similarity = "euclidean", train_points: Optional[np.ndarray] = None,
                  train_labels: Optional[np.ndarray] = None, cell_pixels: int = 64,
                  description: Optional[str] = None) -> dict[str, Path]:
    """Write ``<variant>_node_outputs.png`` and ``<variant>_feature_similarity.png`` into ``out_dir``;
    ``description`` (default: the variant) heads both titles."""
    outputs = layer_outputs(net, grid_points(grid_size))
    weights = [layer.fc.weight.detach().double().cpu().numpy() for layer in net.layers]
    nodes = sample_nodes(net.width, max_nodes, net.in_features)
    out_dir = Path(out_dir)
    model = f"{description or variant.replace('_', ' ')}: residual MLP, {len(weights)} layers x {net.width} nodes"
    shown = "" if len(nodes) == net.width else f", {len(nodes)} of the {net.width} nodes shown"
    node_fig = node_outputs_figure(outputs, weights, nodes, grid_size, net.in_features, train_points,
                                   train_labels, cell_pixels,
                                   title=f"{model}\nnode outputs per layer and the weights between them{shown}")
    sim_fig = similarity_figure(similarity_matrix(outputs, similarity), similarity, title=model)
    return {
        "node_outputs": save_png(figure_to_array(node_fig, dpi=100), out_dir / f"{variant}_node_outputs.png"),
        "feature_similarity": save_png(figure_to_array(sim_fig, dpi=100),
                                       out_dir / f"{variant}_feature_similarity.png"),
    }


def train_on_spiral(depth: int, width: int, epochs: int, residual_droppath: bool = False, drop_rate: float = 0.1,
                    seed: int = 0, num_points: int = 16384, batch_size: int = 256, lr: float = 0.1,
                    accelerator: str = "cpu", out_dir: str | Path = ".",
                    progress: Optional[Progress] = None) -> tuple[SpiralClassifier, Spiral, dict]:
    """Fit :class:`SpiralClassifier` on :class:`Spiral`; returns the model, the data and test metrics.
    With ``progress``, one bar over the epochs."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    L.seed_everything(seed, verbose=False)
    data = Spiral(num_points=num_points, batch_size=batch_size, seed=seed)
    model = SpiralClassifier(ResidualMLP(depth=depth, width=width), lr=lr)
    callbacks = [ResidualDroppath(drop_rate=drop_rate, seed=seed)] if residual_droppath else []
    if progress is not None:
        callbacks.append(EpochProgress(progress, f"train {depth} x {width} residual MLP"))
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
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars (also off when stderr is not a terminal)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Path]:
    """Train, draw, print where the pictures went; returns their paths."""
    args = parse_args(argv)
    if args.cell_pixels < 8:
        raise ValueError(f"cell_pixels must be >= 8, got {args.cell_pixels}")
    variant = "residual_droppath" if args.residual_droppath else "standard"
    description = (f"ResidualDroppath training (drop rate {args.drop_rate:g})" if args.residual_droppath
                   else "standard training")
    with command_progress(show_progress(args.quiet)) as progress:
        stages = progress.add_task(f"feature reuse, {description}: train", total=2)
        model, data, metrics = train_on_spiral(args.depth, args.width, args.epochs, args.residual_droppath,
                                               args.drop_rate, args.seed, args.num_points, args.batch_size, args.lr,
                                               args.accelerator, args.out, progress)
        progress.update(stages, advance=1, description=f"feature reuse, {description}: draw the pictures")
        points, labels = data.train_dataset.tensors
        show = torch.randperm(len(labels), generator=torch.Generator().manual_seed(args.seed))[:400]
        paths = draw_pictures(model.network, args.out, variant, data.grid_size, args.max_nodes, args.similarity,
                              points[show].numpy(), labels[show].numpy(), args.cell_pixels, description)
        progress.update(stages, advance=1, description=f"feature reuse, {description}: done")
    print(f"grid accuracy (nearest-arm labels): {metrics[metric_names.TEST_TOP1]:.4f}")
    for name, path in paths.items():
        print(f"{name}: {path}")
    return paths


if __name__ == "__main__":
    main()
