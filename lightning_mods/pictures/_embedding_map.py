"""The embedding map: a model's embeddings drawn in two dimensions, coloured by label (as
solo-learn's UMAP callback draws it).

scikit-learn's t-SNE (``init="pca"``, seeded) of at most ``max_points`` samples: above that, a
seeded random subset, said in the title. t-SNE keeps neighbourhoods, not distances: clusters
that separate are separable features; their sizes and the gaps between them mean little. A
rich spinner shows on a terminal while it runs (a few seconds for 2,000 points on two cores).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from lightning_mods.pictures.grids import figure_to_array, save_png

EMBEDDING_MAP_POINTS = 2000


def tsne_2d(embeddings: np.ndarray, seed: int = 0) -> np.ndarray:
    """``N x D`` -> ``N x 2`` (t-SNE, perplexity min(30, (N - 1) / 3), PCA init, seeded)."""
    from sklearn.manifold import TSNE

    perplexity = float(min(30.0, max(1.0, (len(embeddings) - 1) / 3)))
    return TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(
        np.asarray(embeddings, dtype=np.float32))


def subsample(count: int, max_points: int, seed: int) -> np.ndarray:
    """Sorted indices of a seeded random subset of ``max_points`` of ``count`` (all when fewer)."""
    if count <= max_points:
        return np.arange(count)
    return np.sort(np.random.default_rng(seed).choice(count, size=max_points, replace=False))


def embedding_map_figure(points: np.ndarray, labels: np.ndarray, title: str,
                         class_names: Optional[Sequence[str]] = None):
    """Scatter of ``N x 2`` points, one colour per label, a legend naming each class."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    classes = sorted(set(labels.tolist()))
    palette = colormaps["tab10" if len(classes) <= 10 else "tab20" if len(classes) <= 20 else "turbo"]
    fig = Figure(figsize=(6.4, 5.2), layout="constrained")
    ax = fig.add_subplot()
    for i, label in enumerate(classes):
        chosen = labels == label
        colour = palette(i % palette.N) if len(classes) <= 20 else palette(i / max(1, len(classes) - 1))
        name = class_names[label] if class_names is not None and 0 <= label < len(class_names) else str(label)
        ax.scatter(points[chosen, 0], points[chosen, 1], s=8, color=colour, label=name, alpha=0.8, linewidths=0)
    ax.set_title(title, fontsize="medium")
    ax.set_xticks([])
    ax.set_yticks([])
    if len(classes) <= 30:
        ax.legend(title="label", fontsize="x-small", loc="center left", bbox_to_anchor=(1.0, 0.5),
                  markerscale=2.0)
    return fig


def write_embedding_map(embeddings: torch.Tensor, labels: torch.Tensor, path: Path,
                        class_names: Optional[Sequence[str]] = None, max_points: int = EMBEDDING_MAP_POINTS,
                        seed: int = 0, title: str = "embeddings") -> Path:
    """Draw the t-SNE map of ``embeddings`` coloured by ``labels`` to ``path`` (PNG)."""
    keep = subsample(len(labels), max_points, seed)
    x = embeddings.detach().float().cpu().numpy()[keep]
    y = labels.detach().cpu().numpy()[keep].astype(int)
    shown = f"t-SNE of {len(keep)} samples" + (f" (a seeded random {len(keep)} of {len(labels)})"
                                               if len(keep) < len(labels) else "")
    if sys.stderr.isatty():
        from rich.console import Console

        with Console(stderr=True).status(f"embedding map: {shown} ..."):
            points = tsne_2d(x, seed)
    else:
        points = tsne_2d(x, seed)
    figure = embedding_map_figure(points, y, f"{title}\n{shown}, coloured by label", class_names)
    return save_png(figure_to_array(figure), path)
