"""EffectiveRank against float64 numpy: the logged entropy and effective rank, the per-block
profile (file, attribute and picture)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from callbacks.measurement.effective_rank import (EffectiveRank, effective_rank, entropy, rank_measures, read_profiles,
                                                  singular_values)
from callbacks.measurement.knn import KNNEvaluator
from lightning_mods.evaluation.over_depth import DEPTH_FILE
from helpers.tiny_runs import HandBuiltBlocks, TinyData, fit_blocks, metric, rows_by_block, tiny_trainer


# --- effective rank against numpy ----------------------------------------------------------
def numpy_entropy(s: np.ndarray) -> float:
    p = s / s.sum()
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def test_effective_rank_matches_numpy_reference():
    x = np.random.default_rng(0).normal(size=(20, 7)) @ np.diag([5, 3, 2, 1, 0.5, 0.1, 0.01])
    cov = np.cov(x)  # the paper's N x N covariance: rows are the variables
    assert cov.shape == (20, 20)
    h_cov = numpy_entropy(np.linalg.svd(cov, compute_uv=False))
    h_feat = numpy_entropy(np.linalg.svd(x, compute_uv=False))
    xt = torch.from_numpy(x)
    got_cov = rank_measures(xt, "covariance", torch.float64)
    got_feat = rank_measures(xt, "features", torch.float64)
    assert got_cov.entropy == pytest.approx(h_cov, rel=1e-10)
    assert got_cov.effective_rank == pytest.approx(math.exp(h_cov), rel=1e-10)
    assert got_feat.entropy == pytest.approx(h_feat, rel=1e-10)
    assert got_feat.effective_rank == pytest.approx(math.exp(h_feat), rel=1e-10)
    # float32 is close, from float32 features too
    got32 = rank_measures(xt.float(), "covariance", torch.float32)
    assert got32.effective_rank == pytest.approx(math.exp(h_cov), rel=1e-4)
    # the pure functions on singular values
    s = torch.tensor([4.0, 2.0, 2.0, 0.0], dtype=torch.float64)
    assert entropy(s).item() == pytest.approx(numpy_entropy(s.numpy()), rel=1e-12)
    assert effective_rank(s).item() == pytest.approx(math.exp(numpy_entropy(s.numpy())), rel=1e-12)


def test_effective_rank_rank_one_and_isotropic():
    rng = np.random.default_rng(1)
    rank_one = torch.from_numpy(np.outer(rng.normal(size=9), rng.normal(size=5)))
    for source in ("covariance", "features"):
        assert rank_measures(rank_one, source).effective_rank == pytest.approx(1.0, abs=1e-9)
        assert rank_measures(rank_one, source).entropy == pytest.approx(0.0, abs=1e-9)
    d = 6
    # features: orthonormal rows, equal singular values
    q, _ = np.linalg.qr(rng.normal(size=(10, d)))
    assert rank_measures(torch.from_numpy(q.T), "features").effective_rank == pytest.approx(d, rel=1e-10)
    # covariance: d orthonormal rows that each sum to zero (already centred) -> d equal eigenvalues
    basis = np.linalg.svd(np.eye(d + 1) - 1.0 / (d + 1), compute_uv=True)[0][:, :d].T
    measures = rank_measures(torch.from_numpy(basis), "covariance")
    assert measures.effective_rank == pytest.approx(d, rel=1e-10)
    assert measures.entropy == pytest.approx(math.log(d), rel=1e-10)
    assert rank_measures(torch.zeros(4, 3), "covariance").effective_rank == 1.0  # collapsed


def test_effective_rank_bad_arguments():
    with pytest.raises(ValueError, match="source"):
        singular_values(torch.randn(3, 3), source="gram")
    with pytest.raises(ValueError, match="dtype"):
        EffectiveRank(dtype="float16")
    with pytest.raises(ValueError, match="singular_values"):
        entropy(torch.tensor([1.0, -1.0]))


def numpy_rank_measures(x: np.ndarray) -> tuple[float, float]:
    """Entropy and exp(entropy) of the normalised singular values of ``x`` (float64)."""
    s = np.linalg.svd(x.astype(np.float64), compute_uv=False)
    p = s[s > 0] / s.sum()
    h = float(-(p * np.log(p)).sum())
    return h, math.exp(h)


def test_per_block_profile_is_a_file_and_an_attribute_not_metrics(tmp_path):
    rank_cb = EffectiveRank(source="features", per_block=True)
    trainer = tiny_trainer(tmp_path, [rank_cb], max_epochs=1, logger=True, default_root_dir=tmp_path)
    data = TinyData()
    trainer.validate(HandBuiltBlocks(), datamodule=data, verbose=False)
    x = data.val_dataset.tensors[0].numpy()
    h1, r1 = numpy_rank_measures(x)
    assert rank_cb.last_profile["entropy"] == pytest.approx([h1, 0.0], abs=1e-12)
    assert rank_cb.last_profile["effective_rank"] == pytest.approx([r1, 1.0], abs=1e-12)
    assert sorted(trainer.callback_metrics) == ["rank/effective_rank", "rank/entropy"]
    assert metric(trainer, "rank/effective_rank") == pytest.approx(r1, rel=1e-6)  # the features = block 1
    run = tmp_path / "lightning_logs" / "version_0"
    header, *rows = (run / "rank_per_block.csv").read_text().splitlines()
    assert header == "epoch,step,block,entropy,effective_rank"
    assert [row.split(",")[:3] for row in rows] == [["0", "0", "1"], ["0", "0", "2"]]
    assert read_profiles(run / "rank_per_block.csv") == {0: rank_cb.last_profile}
    assert [p.name for p in (run / "pictures").glob("*.png")] == ["rank_profile_step0000000.png"]


def test_rank_profile_picture_has_title_axes_and_a_legend_entry_per_epoch():
    from callbacks.measurement.effective_rank import draw_rank_profile

    fig = draw_rank_profile([(4, [3.0, 2.0]), (9, [3.5, 2.5]), (14, [4.0, 3.0])], "effective rank over depth")
    ax = fig.axes[0]
    assert ax.get_title() == "effective rank over depth"
    assert ax.get_xlabel().startswith("block index") and ax.get_ylabel() == "effective rank exp(H)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["epoch 4", "epoch 9", "epoch 14"]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[3.0, 2.0], [3.5, 2.5], [4.0, 3.0]]
    many = draw_rank_profile([(e, [1.0, 2.0]) for e in range(12)])
    assert [t.get_text() for t in many.axes[0].get_legend().get_texts()] == ["epoch 11"]
    assert len(many.axes) == 2  # the colour bar stands for the epochs


def test_per_block_rank_rows_are_numpy_float64_of_each_block(tmp_path):
    """The rank's rows of the per-block table: entropy and effective rank of each block's
    validation features, the paper's N x N covariance spectrum computed by numpy in float64."""
    data = TinyData()
    _, module = fit_blocks(tmp_path, [KNNEvaluator(k=3, blocks=[-1]), EffectiveRank(per_block=True, draw_profile=False)],
                           data=data)
    rows = rows_by_block(tmp_path / DEPTH_FILE, epoch=1)
    assert sorted(rows) == [1, 2]  # the rank covers every block, the kNN only the last
    assert "knn/top1" in rows[2] and "knn/top1" not in rows[1]
    module.eval()
    with torch.no_grad():
        blocks = module.forward_intermediates(data.val_dataset.tensors[0], intermediates_only=True)
    for block in (1, 2):
        h = numpy_entropy(np.linalg.svd(np.cov(blocks[block - 1].double().numpy()), compute_uv=False))
        assert rows[block]["rank/entropy"] == pytest.approx(h, rel=1e-5), block
        assert rows[block]["rank/effective_rank"] == pytest.approx(math.exp(h), rel=1e-5), block
