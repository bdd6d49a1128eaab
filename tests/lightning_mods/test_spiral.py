"""Spiral data, residual MLP and the feature-reuse pictures (the ResidualDroppath paper, section 3)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.spatial import cKDTree

from datamodules.spiral import Spiral, grid_points, nearest_arm_labels, spiral_points
from commands.feature_reuse import linear_cka, main, pairwise_euclidean, sample_nodes
from lightning_mods.spiral_classifier import SpiralClassifier
from lightning_mods.backbone.residual_mlp import ResidualMLP
from lightning_mods.backbone.shortcut import ShortcutSchedule


def test_class_geometry_matches_the_formula():
    points, labels = spiral_points(16384, seed=0)
    assert points.shape == (16384, 2) and points.dtype == torch.float32 and labels.dtype == torch.int64
    assert torch.bincount(labels).tolist() == [8192, 8192]
    p = points.double()
    r = p.norm(dim=1)
    assert 0.0 <= r.min() and r.max() <= 1.0
    a = 2 * math.pi * r  # radius a / (2 pi) <=> angle 2 pi r
    arm = torch.stack([r * torch.sin(a), r * torch.cos(a)], dim=1)  # class 0 at angle a
    shifted = torch.stack([r * torch.sin(a + math.pi), r * torch.cos(a + math.pi)], dim=1)  # class 1 at a + pi
    torch.testing.assert_close(p[labels == 0], arm[labels == 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(p[labels == 1], shifted[labels == 1], rtol=0, atol=1e-5)
    # one angle per pair: class-1 point i is class-0 point i turned by pi
    torch.testing.assert_close(p[labels == 1], -p[labels == 0], rtol=0, atol=1e-6)
    # angles uniform on (0, 2 pi) <=> radii uniform on (0, 1): mean 1/2, variance 1/12
    assert abs(r.mean().item() - 0.5) < 0.01 and abs(r.var().item() - 1 / 12) < 0.005


def test_draws_are_fixed_by_the_seed():
    a, _ = spiral_points(64, seed=3)
    b, _ = spiral_points(64, seed=3)
    c, _ = spiral_points(64, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    with pytest.raises(ValueError, match="num_points"):
        spiral_points(7, seed=0)


def test_grid_order_and_nearest_arm_labels():
    grid = grid_points(50)
    xs = np.linspace(-1, 1, 50)
    assert grid.shape == (2500, 2)
    for k in (0, 1, 49, 50, 1234, 2499):
        assert grid[k].tolist() == pytest.approx([xs[k % 50], xs[k // 50]], abs=1e-7)
    # points on the arms themselves (angle 3 and 5 rad)
    on_arm = torch.tensor([[3 / (2 * math.pi) * math.sin(3.0), 3 / (2 * math.pi) * math.cos(3.0)],
                           [5 / (2 * math.pi) * math.sin(5.0), 5 / (2 * math.pi) * math.cos(5.0)]])
    assert nearest_arm_labels(on_arm).tolist() == [0, 0]
    assert nearest_arm_labels(-on_arm).tolist() == [1, 1]
    # brute force with a finer arm sampling, where the two arms are not nearly equidistant
    angle = np.linspace(0, 2 * np.pi, 100001)
    arm0 = np.stack([angle / (2 * np.pi) * np.sin(angle), angle / (2 * np.pi) * np.cos(angle)], 1)
    g = grid.double().numpy()
    d0, _ = cKDTree(arm0).query(g)
    d1, _ = cKDTree(-arm0).query(g)
    clear = np.abs(d0 - d1) > 2e-3
    assert clear.mean() > 0.95
    assert np.array_equal(nearest_arm_labels(grid).numpy()[clear], (d1 < d0).astype(np.int64)[clear])


def test_datamodule_splits_and_batches():
    dm = Spiral(num_points=512, val_points=64, grid_size=10, batch_size=256)
    dm.setup("fit")
    points, labels = next(iter(dm.train_dataloader()))
    assert points.shape == (256, 2) and points.dtype == torch.float32 and labels.dtype == torch.int64
    assert len(dm.train_dataset) == 512 and len(dm.val_dataset) == 64
    test_points, test_labels = next(iter(dm.test_dataloader()))
    assert test_points.shape == (100, 2) and torch.equal(test_points, grid_points(10))
    assert torch.equal(test_labels, nearest_arm_labels(grid_points(10)))
    assert not torch.equal(dm.train_dataset.tensors[0][:64], dm.val_dataset.tensors[0])
    assert dm.num_classes == 2
    with pytest.raises(ValueError, match="num_points"):
        Spiral(num_points=3)


def gelu64(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


@pytest.mark.parametrize("shortcut,alphas", [(None, [1.0, 1.0, 1.0]),
                                             (ShortcutSchedule("linear", 0.5), [1.0, 0.75, 0.5])])
def test_residual_mlp_by_hand(shortcut, alphas):
    torch.manual_seed(0)
    net = ResidualMLP(depth=3, width=5, shortcut=shortcut)
    points = torch.rand(7, 2) * 2 - 1
    p = {k: v.double() for k, v in net.state_dict().items()}
    h = torch.cat([points.double(), torch.zeros(7, 3, dtype=torch.float64)], dim=1)
    layers = []
    for k, a in enumerate(alphas):
        h = a * h + gelu64(h @ p[f"layers.{k}.fc.weight"].T + p[f"layers.{k}.fc.bias"])
        layers.append(h)
    expected = h @ p["head.weight"].T + p["head.bias"]
    with torch.no_grad():
        torch.testing.assert_close(net(points).double(), expected, rtol=1e-5, atol=1e-6)
        model = SpiralClassifier(ResidualMLP(depth=3, width=5, shortcut=shortcut))
        model.network.load_state_dict(net.state_dict())
        blocks = model.forward_intermediates(points, intermediates_only=True)
        assert len(blocks) == 3
        for got, want in zip(blocks, layers):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="width"):
        ResidualMLP(depth=2, width=1)


def test_similarity_measures():
    x = np.random.default_rng(0).normal(size=(50, 4))
    q, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(4, 4)))
    assert linear_cka(x, x) == pytest.approx(1.0)
    assert linear_cka(x, 3 * x @ q + 1) == pytest.approx(1.0)  # invariant to rotation, scale, shift
    assert linear_cka(x, np.random.default_rng(2).normal(size=(50, 4))) < 0.5
    d = pairwise_euclidean([np.zeros((3, 2)), np.array([[3.0, 4], [0, 1], [0, 0]])])
    assert d.tolist() == [[0.0, 2.0], [2.0, 0.0]]  # mean of 5, 1, 0


def test_node_sampling_keeps_the_input_nodes():
    assert sample_nodes(6, 8) == list(range(6))
    nodes = sample_nodes(32, 8)
    assert len(nodes) == 8 and nodes[:2] == [0, 1] and nodes[-1] == 31 and nodes == sorted(set(nodes))


def png_size(path) -> tuple[int, int]:
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size  # (width, height)


def test_picture_command_writes_pngs_of_the_expected_size(tmp_path, capsys):
    paths = main(["--depth", "3", "--width", "4", "--epochs", "1", "--num-points", "256", "--out", str(tmp_path),
                  "--cell-pixels", "64", "--quiet"])
    assert paths["node_outputs"] == tmp_path / "standard_node_outputs.png"
    # 2N + 1 columns and H rows of 64-pixel cells inside margins of 110 + 120 and 80 + 90 pixels
    assert png_size(paths["node_outputs"]) == (110 + (2 * 3 + 1) * 64 + 120, 80 + 4 * 64 + 90)
    assert png_size(paths["feature_similarity"]) == (600, 500)
    assert "grid accuracy" in capsys.readouterr().out

    paths = main(["--depth", "2", "--width", "12", "--epochs", "1", "--num-points", "256", "--out", str(tmp_path),
                  "--cell-pixels", "16", "--max-nodes", "5", "--residual-droppath", "--similarity", "cka"])
    assert "residual MLP" not in capsys.readouterr().err  # stderr is no terminal here: no progress bar
    assert paths["node_outputs"].name == "residual_droppath_node_outputs.png"
    assert png_size(paths["node_outputs"]) == (620, 80 + 5 * 16 + 90)  # 12 nodes down to 5 rows; minimum width
    assert png_size(paths["feature_similarity"]) == (600, 500)


def test_node_picture_has_title_labels_legend_and_colour_bar():
    from commands.feature_reuse import node_outputs_figure

    grid = 5
    outputs = [np.random.default_rng(i).normal(size=(grid * grid, 3)) for i in range(3)]  # input, layers 1, 2
    weights = [np.eye(3), -np.eye(3)]
    fig = node_outputs_figure(outputs, weights, [0, 1, 2], grid, train_points=np.zeros((4, 2)),
                              train_labels=np.array([0, 1, 0, 1]), title="a model")
    assert fig._suptitle.get_text() == "a model"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "positive weight (width: |W|)", "negative weight", "class 0 training points", "class 1 training points"]
    headings = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert headings == ["input", "layer 1", "layer 2", "W1", "W2"]
    row_labels = [ax.get_ylabel() for ax in fig.axes[:3]]  # the input column, drawn first
    assert row_labels == ["node 0\n(input x1)", "node 1\n(input x2)", "node 2"]
    colour_bar = fig.axes[-1]
    assert "max |output|" in colour_bar.get_ylabel() and colour_bar.get_ylim() == (-1.0, 1.0)


def test_spiral_accuracy_is_the_fraction_of_points_right():
    """Class sizes 3 / 1, three of four right: 3/4 (the mean of the class recalls would be
    (2/3 + 1) / 2 = 5/6)."""
    from lightning_mods.spiral_classifier import SpiralClassifier

    model = SpiralClassifier()
    logits = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 0, 1])
    for metric in (model.train_acc, model.val_acc, model.test_acc):
        metric(logits, labels)
        assert metric.compute().item() == pytest.approx(3 / 4)
