"""Pictures of a run: written as PNG under ``<run folder>/pictures`` and sent to every logger
that shows images (TensorBoard, W&B, MLflow: :mod:`lightning_mods.run_outputs.to_loggers`).
Only global rank 0 writes."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np
from lightning.pytorch import Trainer

from lightning_mods.run_outputs.run_folder import picture_dir, run_dir
from lightning_mods.run_outputs.to_loggers import send_image

if TYPE_CHECKING:
    from matplotlib.axes import Axes

try:  # matplotlib is a dependency, but keep the module importable in minimal installs
    from matplotlib.figure import Figure
except ImportError:  # pragma: no cover
    Figure = None  # type: ignore[assignment,misc]

Picture = Union[np.ndarray, "Figure"]


def figure_to_array(fig: "Figure", dpi: int = 100) -> np.ndarray:
    """Render a matplotlib figure to an ``H x W x 3`` uint8 array."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    fig.set_dpi(dpi)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def to_uint8_image(image: np.ndarray) -> np.ndarray:
    """``H x W``, ``H x W x C`` (C in 1, 3, 4) floats in [0, 1] or uint8 -> ``H x W x 3`` uint8."""
    image = np.asarray(image)
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"image must be HxW or HxWxC with C in (1, 3, 4), got shape {image.shape}")
    if image.dtype != np.uint8:
        image = (np.clip(image, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    if image.shape[-1] == 1:
        image = np.repeat(image, 3, axis=-1)
    return image[..., :3]


def save_png(image: np.ndarray, path: Union[str, os.PathLike]) -> Path:
    """Write an image array as PNG (through Pillow, which torchvision brings)."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(to_uint8_image(image)).save(path, format="PNG")
    return path


def log_picture(trainer: Trainer, tag: str, picture: Picture, step: int | None = None) -> Path | None:
    """Save ``picture`` as ``<run folder>/pictures/<tag>_step<step>.png`` and send it to every logger.

    Returns the file written on rank 0, ``None`` on other ranks.
    """
    if not trainer.is_global_zero:
        return None
    if Figure is not None and isinstance(picture, Figure):
        image = figure_to_array(picture)
    else:
        image = to_uint8_image(picture)
    step = trainer.global_step if step is None else step
    safe_tag = tag.replace("/", "_")
    path = save_png(image, picture_dir(trainer) / f"{safe_tag}_step{step:07d}.png")
    send_image(trainer, tag, image, step, run_dir(trainer))
    return path


def image_grid(images: np.ndarray, nrow: int, pad: int = 2, pad_value: float = 1.0,
               min_tile: int = 64) -> np.ndarray:
    """Tile ``N x H x W x C`` images (floats in [0, 1]) into one ``H' x W' x C`` picture.

    Tiles smaller than ``min_tile`` pixels are enlarged by a whole factor (nearest neighbour,
    so every pixel stays a visible square): 16-pixel digits are unreadable at their size.
    """
    images = np.asarray(images, dtype=np.float32)
    if images.ndim == 4 and images.shape[0]:
        factor = max(1, min_tile // max(images.shape[1], images.shape[2]))
        images = images.repeat(factor, axis=1).repeat(factor, axis=2)
    n, h, w, c = images.shape
    ncol = int(np.ceil(n / nrow)) if n else 0
    grid = np.full((pad + ncol * (h + pad), pad + nrow * (w + pad), c), pad_value, dtype=np.float32)
    for i in range(n):
        r, q = divmod(i, nrow)
        grid[pad + r * (h + pad): pad + r * (h + pad) + h, pad + q * (w + pad): pad + q * (w + pad) + w] = images[i]
    return grid


def labelled_grid(tiles: np.ndarray, title: str, row_labels: Optional[Sequence[str]] = None,
                  col_labels: Optional[Sequence[str]] = None, pad: int = 2, min_tile: int = 96,
                  dpi: int = 100) -> "Figure":
    """``rows x cols x H x W x C`` images (floats in [0, 1]) as one titled figure: the tiles of
    :func:`image_grid` (enlarged to ``min_tile`` pixels), a label left of every row and above
    every column when given."""
    tiles = np.asarray(tiles, dtype=np.float32)
    if tiles.ndim != 5:
        raise ValueError(f"tiles must be rows x cols x H x W x C, got shape {tiles.shape}")
    rows, cols = tiles.shape[:2]
    for name, labels, count, what in (("row_labels", row_labels, rows, "row"),
                                      ("col_labels", col_labels, cols, "column")):
        if labels is not None and len(labels) != count:
            raise ValueError(f"{name} needs {count} label(s), one per {what}, got {len(labels)}")
    grid = image_grid(tiles.reshape(rows * cols, *tiles.shape[2:]), nrow=cols, pad=pad, min_tile=min_tile)
    tile_h, tile_w = (grid.shape[0] - pad) / max(rows, 1), (grid.shape[1] - pad) / max(cols, 1)
    fig, ax = _grid_axes(grid.shape[1] / dpi, grid.shape[0] / dpi, title, row_labels, col_labels, dpi)
    image = grid[..., 0] if grid.shape[-1] == 1 else grid
    ax.imshow(image, cmap="gray" if image.ndim == 2 else None, vmin=0.0, vmax=1.0, interpolation="nearest")
    if row_labels is not None:
        ax.set_yticks(pad / 2 + tile_h * (np.arange(rows) + 0.5), [str(label) for label in row_labels])
    else:
        ax.set_yticks([])
    if col_labels is not None:
        ax.set_xticks(pad / 2 + tile_w * (np.arange(cols) + 0.5), [str(label) for label in col_labels])
    else:
        ax.set_xticks([])
    ax.xaxis.tick_top()
    ax.tick_params(length=0, labelsize=8)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(title, fontsize=9)
    return fig


# labelled_grid's margins, in inches, from the text they hold (DejaVu Sans: a 9 pt title character
# is about 0.07 in wide and a line 0.155 in high, an 8 pt label character 0.068 in): fixed margins
# instead of constrained layout, which took a fifth of a picture's drawing time (it measures
# every text's extent); tests/lightning_mods/test_pictures.py renders the pictures and checks that every text
# lies inside the figure and off the images
_EDGE = 0.1  # blank border around everything
_TITLE_CHAR, _TITLE_LINE, _TITLE_PAD = 0.07, 0.155, 0.1
_LABEL_CHAR, _LABEL_HEIGHT, _LABEL_PAD = 0.068, 0.14, 0.06


def _grid_axes(grid_width: float, grid_height: float, title: str, row_labels: Optional[Sequence[str]],
               col_labels: Optional[Sequence[str]], dpi: int) -> tuple["Figure", "Axes"]:
    """A figure and an axes of exactly ``grid_width x grid_height`` inches (one image pixel per
    pixel at ``dpi``), with room left of it for the row labels, above it for the column labels
    and the title (centred over the axes, as ``set_title`` places it)."""
    label_width = max((len(str(label)) for label in row_labels or ()), default=0)
    title_lines = title.splitlines() or [""]
    title_width = _TITLE_CHAR * max(len(line) for line in title_lines)
    left = _EDGE + (_LABEL_PAD + _LABEL_CHAR * label_width if row_labels is not None else 0.0)
    left = max(left, _EDGE + title_width / 2 - grid_width / 2)  # the title's left end inside
    width = max(left + grid_width + _EDGE, left + grid_width / 2 + title_width / 2 + _EDGE)
    top = _EDGE + _TITLE_LINE * len(title_lines) + _TITLE_PAD + (_LABEL_HEIGHT + _LABEL_PAD if col_labels else 0.0)
    height = top + grid_height + _EDGE
    fig = Figure(figsize=(width, height), dpi=dpi)
    ax = fig.add_axes((left / width, _EDGE / height, grid_width / width, grid_height / height))
    return fig, ax
