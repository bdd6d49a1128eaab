"""KNNEvaluator and its pure functions on hand-built points: the weighted vote, ties, top-5,
chunking, and its argument checks; its per-block figures (``blocks``) equal ``knn_predict`` on
block features extracted by hand, and their mean feature norm numpy float64's."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from callbacks.measurement.knn import KNNEvaluator, knn_classify, knn_predict
from callbacks.measurement.knn_scoring import topk_correct
from lightning_mods.evaluation.over_depth import DEPTH_FILE
from helpers.tiny_runs import PNG_SIGNATURE, TinyData, fit_blocks, rows_by_block


# --- kNN on hand-built points -------------------------------------------------------------
def on_circle(degrees, radius=1.0) -> torch.Tensor:
    a = torch.tensor(degrees, dtype=torch.float64) * math.pi / 180
    return (radius * torch.stack([a.cos(), a.sin()], dim=1)).float()


def test_knn_weighted_vote_beats_the_majority():
    # query at 0 deg; neighbours: class 0 at 0 deg (cos 1), class 1 at +-60 deg (cos 1/2);
    # a class-2 point at 180 deg lies outside k = 3. The bank points have different norms.
    bank = on_circle([0, 60, -60, 180], radius=1.0) * torch.tensor([[3.0], [0.5], [2.0], [1.0]])
    labels = torch.tensor([0, 1, 1, 2])
    query = on_circle([0])
    t = 0.1
    scores = knn_predict(bank, labels, query, num_classes=3, k=3, temperature=t)
    expected = torch.tensor([[math.exp(1 / t), 2 * math.exp(0.5 / t), 0.0]])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=0)
    assert knn_classify(bank, labels, query, 3, k=3, temperature=t).tolist() == [0]
    # a hot vote is nearly the plain majority: class 1 wins
    assert knn_classify(bank, labels, query, 3, k=3, temperature=100.0).tolist() == [1]
    # with k = 4 the class-2 point votes with exp(-1 / T)
    scores4 = knn_predict(bank, labels, query, num_classes=3, k=4, temperature=t)
    assert scores4[0, 2].item() == pytest.approx(math.exp(-1 / t), rel=1e-5)


def test_knn_several_queries_and_ties():
    bank = on_circle([10, 20, 100, 110, 200])
    labels = torch.tensor([0, 0, 1, 1, 2])
    queries = on_circle([15, 105, 190, 60])
    t = 0.5
    scores = knn_predict(bank, labels, queries, num_classes=3, k=2, temperature=t)
    cos = lambda d: math.cos(math.radians(d))  # noqa: E731
    expected = torch.tensor([
        [math.exp(cos(5) / t) * 2, 0, 0],
        [0, math.exp(cos(5) / t) * 2, 0],
        [0, math.exp(cos(80) / t), math.exp(cos(10) / t)],  # neighbours 110 (80 deg away) and 200
        [math.exp(cos(40) / t), math.exp(cos(40) / t), 0],  # 20 and 100 are both 40 deg away: a tie
    ])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)
    # the tie of the last query goes to the lower class index
    assert knn_classify(bank, labels, queries, 3, k=2, temperature=t).tolist() == [0, 1, 2, 0]
    correct = topk_correct(scores, torch.tensor([0, 1, 1, 1]), ks=(1, 2))
    assert correct.tolist() == [2, 4]


def test_knn_top5_counts_only_classes_that_got_a_vote():
    """Six classes on a circle, k=2: each query's two neighbours vote for at most two classes, so
    its top-5 holds three or more classes with no vote, filled in by class index. Those never
    count: top-5 is the top-2 accuracy here (DINO caps top-5 at the voted classes)."""
    bank = on_circle([0, 60, 120, 180, 240, 300])
    labels = torch.arange(6)
    queries = on_circle([10, 130, 250, 20])  # the two nearest: classes {0, 1}, {2, 3}, {4, 5}, {0, 1}
    scores = knn_predict(bank, labels, queries, num_classes=6, k=2, temperature=0.1)
    assert [set(torch.nonzero(row).flatten().tolist()) for row in scores] == [{0, 1}, {2, 3}, {4, 5}, {0, 1}]
    # true labels: 0 (voted, 1st); 4 (no vote, ranked 5th by index: 2, 3, 0, 1, 4); 5 (voted, 2nd);
    # 3 (no vote, ranked 4th: 0, 1, 2, 3)
    truth = torch.tensor([0, 4, 5, 3])
    assert topk_correct(scores, truth, ks=(1, 2, 5)).tolist() == [1, 2, 2]  # counting unvoted classes: 4 at top-5


def test_knn_chunking_and_small_bank():
    g = torch.Generator().manual_seed(0)
    bank, queries = torch.randn(50, 5, generator=g), torch.randn(17, 5, generator=g)
    labels = torch.randint(0, 4, (50,), generator=g)
    whole = knn_predict(bank, labels, queries, 4, k=7)
    torch.testing.assert_close(knn_predict(bank, labels, queries, 4, k=7, chunk_size=3), whole)
    # k larger than the bank: every bank sample votes
    all_votes = knn_predict(bank[:5], labels[:5], queries, 4, k=20, temperature=1.0)
    sims = torch.nn.functional.normalize(queries, dim=1) @ torch.nn.functional.normalize(bank[:5], dim=1).T
    expected = torch.zeros(17, 4).index_add_(1, labels[:5], sims.exp())
    torch.testing.assert_close(all_votes, expected)


@pytest.mark.parametrize("kwargs, field", [({"k": 0}, "k"), ({"temperature": 0.0}, "temperature"),
                                           ({"num_classes": 2}, "bank_labels")])
def test_knn_bad_arguments(kwargs, field):
    args = dict(bank_feats=torch.randn(4, 2), bank_labels=torch.tensor([0, 1, 2, 0]), query_feats=torch.randn(1, 2),
                num_classes=3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        knn_predict(**args)
    with pytest.raises(ValueError, match="every_n_epochs"):
        KNNEvaluator(every_n_epochs=0)


def test_per_block_knn_equals_knn_predict_on_hand_extracted_block_features(tmp_path):
    data = TinyData()
    trainer, module = fit_blocks(tmp_path, [KNNEvaluator(k=5, blocks="all")], data=data)
    rows = rows_by_block(tmp_path / DEPTH_FILE, epoch=1)
    assert sorted(rows) == [1, 2]
    module.eval()
    with torch.no_grad():
        bank_x, bank_y = data.bank_dataset.tensors
        val_x, val_y = data.val_dataset.tensors
        # in the pass's batches: a product's rounding may depend on the rows it is computed with
        def by_batch(x):  # noqa: ANN001, ANN202
            parts = [module.forward_intermediates(b, intermediates_only=True) for b in x.split(data.batch_size)]
            return [torch.cat(blocks) for blocks in zip(*parts)]
        bank_blocks, val_blocks = by_batch(bank_x), by_batch(val_x)
    for block in (1, 2):
        scores = knn_predict(bank_blocks[block - 1], bank_y, val_blocks[block - 1], num_classes=3, k=5)
        expected = int(topk_correct(scores, val_y, ks=(1,))[0]) / len(val_y)
        assert rows[block]["knn/top1"] == expected, block
        norms = np.linalg.norm(val_blocks[block - 1].double().numpy(), axis=1)
        assert rows[block]["feature/norm"] == pytest.approx(float(norms.mean()), rel=1e-12)
    # the logged metric is still that of forward_features (the last block for TinyNet)
    assert float(trainer.callback_metrics["knn/top1"]) == rows[2]["knn/top1"]
    assert (tmp_path / "pictures").is_dir()
    pictures = sorted((tmp_path / "pictures").glob("eval_over_depth_step*.png"))
    assert len(pictures) == 2 and pictures[-1].read_bytes()[:8] == PNG_SIGNATURE  # one per evaluation