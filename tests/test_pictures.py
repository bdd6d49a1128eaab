"""Pictures a reader understands without the code: labelled, titled image grids."""
import numpy as np
import pytest

from lightning_mods.pictures import figure_to_array, image_grid, labelled_grid


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
