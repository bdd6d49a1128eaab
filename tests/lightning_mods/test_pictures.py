"""Pictures a reader understands without the code: labelled, titled image grids."""
import numpy as np
import pytest

from lightning_mods.pictures.grids import figure_to_array, image_grid, labelled_grid


def test_labelled_grid_shows_the_raw_grid_with_row_and_column_labels():
    tiles = np.random.default_rng(0).random((2, 3, 4, 4, 3)).astype(np.float32)
    fig = labelled_grid(tiles, "a title", row_labels=["first", "second"], col_labels=["a", "b", "c"], min_tile=8)
    ax = fig.axes[0]
    assert ax.get_title() == "a title"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["first", "second"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    # the picture is image_grid's tiles, row-major, each tile enlarged 2x; the labels sit on the tile centres
    np.testing.assert_array_equal(ax.images[0].get_array(), image_grid(tiles.reshape(6, 4, 4, 3), nrow=3, min_tile=8))
    np.testing.assert_allclose(ax.get_yticks(), [1 + 5, 1 + 10 + 5])  # pad 2, tiles 8 + 2 pad
    np.testing.assert_allclose(ax.get_xticks(), [6, 16, 26])
    assert figure_to_array(fig).ndim == 3


def test_labelled_grid_refuses_labels_that_do_not_fit():
    with pytest.raises(ValueError, match="row_labels needs 2"):
        labelled_grid(np.zeros((2, 1, 4, 4, 1)), "t", row_labels=["only one"])
    with pytest.raises(ValueError, match="rows x cols x H x W x C"):
        labelled_grid(np.zeros((2, 4, 4, 1)), "t")


MAE_TITLE = ("MaskedAutoencoder reconstructions, epoch 100, step 1100\nvalidation images, 75% of the patches "
             "masked;\nreconstruction: the visible patches pasted back")


@pytest.mark.parametrize("title, rows, cols, row_labels, col_labels", [
    (MAE_TITLE, 8, 3, [f"val {i}" for i in range(8)], ["original", "masked input", "reconstruction"]),
    ("MaskedAutoencoder patch features, last block, epoch 100, step 1100\ntop-3 principal components over "
     "these 8 validation images as RGB", 2, 8, ["input", "patch PCA"], [str(i) for i in range(8)]),
    ("a title far wider than its one small picture, as a long run name makes it", 1, 1,
     ["a much longer row label than usual"], None),
    ("WWWW MMMM capitals are the widest characters of all", 1, 2, None, ["a", "b"]),
    ("no labels", 2, 2, None, None),
])
def test_labelled_grid_keeps_every_text_inside_the_picture_and_off_the_images(title, rows, cols, row_labels,
                                                                                col_labels):
    """The margins are set from estimates of the text sizes (no layout engine): rendered, every
    text must lie inside the figure, off the images and off the other texts, and the images
    are drawn one image pixel per picture pixel."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    tiles = np.random.default_rng(0).random((rows, cols, 16, 16, 1)).astype(np.float32)
    fig = labelled_grid(tiles, title, row_labels=row_labels, col_labels=col_labels)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = fig.axes[0]
    images = ax.get_window_extent(renderer)
    grid = image_grid(tiles.reshape(rows * cols, 16, 16, 1), nrow=cols, min_tile=96)
    assert (round(images.width), round(images.height)) == (grid.shape[1], grid.shape[0])
    boxes = [t.get_window_extent(renderer) for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    assert len(boxes) == 1 + len(row_labels or ()) + len(col_labels or ())  # the title, every label
    for box in boxes:
        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height, box
        assert not _intersect(box, images), box
    for i, box in enumerate(boxes):
        assert not any(_intersect(box, other) for other in boxes[i + 1:]), box


def _intersect(a, b) -> bool:  # noqa: ANN001
    return min(a.x1, b.x1) - max(a.x0, b.x0) > 0.5 and min(a.y1, b.y1) - max(a.y0, b.y0) > 0.5


def test_image_grid_tiles_and_enlarges_small_images():
    from lightning_mods.pictures.grids import image_grid

    a = np.array([[0.0, 0.25], [0.5, 1.0]], dtype=np.float32)[:, :, None]
    b = np.full((2, 2, 1), 0.75, dtype=np.float32)
    grid = image_grid(np.stack([a, b]), nrow=2, pad=1, pad_value=0.5, min_tile=4)
    expected = np.full((1 + 4 + 1, 1 + 2 * (4 + 1), 1), 0.5, dtype=np.float32)
    expected[1:5, 1:5, 0] = [[0, 0, 0.25, 0.25], [0, 0, 0.25, 0.25], [0.5, 0.5, 1, 1], [0.5, 0.5, 1, 1]]
    expected[1:5, 6:10, 0] = 0.75
    np.testing.assert_array_equal(grid, expected)
    assert image_grid(np.stack([a, b]), nrow=1, pad=0, min_tile=1).shape == (4, 2, 1)
