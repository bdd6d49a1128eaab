"""The kNN bank split over ranks: at 3 real processes (gloo, launched with torchrun) each
rank keeps only the bank rows it embedded, and the accuracies (one k, a list of k, over depth)
equal float64 numpy's weighted vote on the whole bank and the one-process run; the bank it saves
is scored again by ``shortcutlab score-bank`` at other settings with the accuracies a run at those
settings gives."""
from __future__ import annotations

from helpers import folders

import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer

from callbacks.measurement.knn import KNNEvaluator
from helpers.tiny_runs import Passthrough, TinyData

# the launched processes import this module: what only the test process needs is imported there

REPO = Path(__file__).resolve().parents[2]
BANK, QUERIES, CLASSES, DIM = 103, 29, 7, 8  # 103 rows in batches of 8: shards of 39, 32 and 32 rows at 3 ranks
# (rank 0 holds batches 0, 3, 6, 9 and the last one, of 7 rows)


class ProjectedBlocks(Passthrough):
    """Two fixed blocks: ``x A`` and ``tanh(x A) B``; the features are the second."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.register_buffer("a", torch.randn(DIM, 6, generator=g))
        self.register_buffer("b", torch.randn(6, 5, generator=g))

    def forward_intermediates(self, x, indices=None, intermediates_only=False):  # noqa: ANN001
        first = x @ self.a
        blocks = [first, torch.tanh(first) @ self.b]
        return blocks if intermediates_only else (blocks[1], blocks)

    def forward_features(self, x):  # noqa: ANN001
        return self.forward_intermediates(x)[0]


def bank_data() -> TinyData:
    return TinyData(n_train=BANK, n_val=QUERIES, num_classes=CLASSES, dim=DIM, batch_size=8, spread=2.5)


def make_callbacks(saved: Path) -> list[KNNEvaluator]:
    return [KNNEvaluator(k=5, bank_dtype="float32", name="one"),
            KNNEvaluator(k=[1, 5, 20, 200], blocks="all", bank_dtype="float32", name="grid"),
            KNNEvaluator(k=[3, 9], temperature=0.1, blocks="all", bank_dtype="float16", save_features=str(saved),
                         name="half")]


def seen(trainer: Trainer, callbacks: list[KNNEvaluator]) -> dict:
    return {"metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "blocks": [cb._block_values for cb in callbacks]}


SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    from pathlib import Path
    sys.path[:0] = {tests!r}
    warnings.filterwarnings("ignore")
    from lightning.pytorch import Trainer
    from test_sharded_knn import ProjectedBlocks, bank_data, make_callbacks, seen

    out, devices = Path(sys.argv[1]), int(sys.argv[2])
    callbacks = make_callbacks(out / "bank")
    trainer = Trainer(accelerator="cpu", devices=devices, strategy="ddp", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=list(callbacks), default_root_dir=out)
    trainer.validate(ProjectedBlocks(), datamodule=bank_data(), verbose=False)
    (out / f"rank{{trainer.global_rank}}.json").write_text(json.dumps(seen(trainer, callbacks)))
""")


def numpy_accuracy(bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, labels: torch.Tensor,
                   k: int, temperature: float, top: int) -> float:
    from test_several_settings import numpy_knn_scores

    scores = numpy_knn_scores(bank.double().numpy(), bank_labels.numpy(), queries.double().numpy(), CLASSES,
                              min(k, len(bank)), temperature)
    ranked = np.argsort(-scores, axis=1, kind="stable")[:, :top]
    # a class no neighbour voted for never counts (DINO's top-5 at fewer than 5 voted classes)
    return float(np.mean([label in row and score[label] > 0
                          for label, row, score in zip(labels.numpy(), ranked, scores)]))


def reference(module: ProjectedBlocks, k: int, temperature: float, block: int | None, top: int) -> float:
    data = bank_data()
    (bank_x, bank_y), (val_x, val_y) = data.bank_dataset.tensors, data.val_dataset.tensors
    with torch.no_grad():
        pick = (lambda x: module.forward_features(x)) if block is None else (
            lambda x: module.forward_intermediates(x, intermediates_only=True)[block - 1])
        return numpy_accuracy(pick(bank_x), bank_y, pick(val_x), val_y, k, temperature, top)


def hits(accuracy: float) -> int:
    """The queries an accuracy counts."""
    return round(accuracy * QUERIES)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_shortcutlab) -> dict[int, list[dict]]:
    """What every rank saw at 1 (this process) and 3 processes (warm forks, tests/helpers/fork_server.py),
    and the folders they ran in."""
    from test_callbacks_ddp import ranks_seen

    root = tmp_path_factory.mktemp("sharded_knn")
    script = root / "run.py"
    script.write_text(SCRIPT.format(tests=folders.PATHS))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    found = {}
    found[3] = ranks_seen(script, root / "w3", 3, ["3"], warm_shortcutlab, env)
    single = root / "w1"
    callbacks = make_callbacks(single / "bank")
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=list(callbacks), default_root_dir=single)
    trainer.validate(ProjectedBlocks(), datamodule=bank_data(), verbose=False)
    found[1] = [seen(trainer, callbacks)]
    found["root"] = root
    return found


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 3])
def test_sharded_bank_equals_numpy_on_the_whole_bank(runs, devices):
    module = ProjectedBlocks()
    for rank in runs[devices]:
        assert rank == runs[devices][0]  # every rank logs the same values
    metrics, blocks = runs[devices][0]["metrics"], runs[devices][0]["blocks"]
    assert hits(metrics["knn/top1@one"]) == hits(reference(module, 5, 0.07, None, 1))  # logged: float32
    assert hits(metrics["knn/top5@one"]) == hits(reference(module, 5, 0.07, None, 5))
    for k in (1, 5, 20, 200):  # a list of k, 200 beyond the bank's 103 rows
        assert hits(metrics[f"knn/top1@grid,k={k}"]) == hits(reference(module, k, 0.07, None, 1)), k
        assert hits(metrics[f"knn/top5@grid,k={k}"]) == hits(reference(module, k, 0.07, None, 5)), k
    for row in blocks[1]:  # over depth
        for k in (1, 5, 20, 200):
            assert row[f"knn/top1@grid,k={k}"] == reference(module, k, 0.07, row["block"], 1), (row["block"], k)
    assert sorted(row["block"] for row in blocks[1]) == [1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("devices", [3])
def test_a_float16_bank_gives_the_one_process_accuracies(runs, devices):
    """Half the memory: sharding changes nothing, whatever the dtype (each row is stored alike)."""
    half = {name: v for name, v in runs[devices][0]["metrics"].items() if "@half," in name}
    assert half and half == {name: v for name, v in runs[1][0]["metrics"].items() if "@half," in name}
    for row, alone in zip(runs[devices][0]["blocks"][2], runs[1][0]["blocks"][2], strict=True):
        row, alone = dict(row), dict(alone)
        # the block's mean feature norm: within rounding (the launched processes run one thread each)
        assert row.pop("feature/norm") == pytest.approx(alone.pop("feature/norm"), rel=1e-6)
        assert row == alone


@pytest.mark.slow
def test_each_rank_saved_only_its_rows_and_the_command_scores_them_at_other_settings(runs):
    from commands import score_bank

    folder = runs["root"] / "w3" / "bank"
    shards = [torch.load(folder / f"bank-rank{r:05d}-of-00003.pt", weights_only=True) for r in range(3)]
    assert [len(s["labels"]) for s in shards] == [39, 32, 32]
    assert all(s["features"].dtype == torch.float16 and s["total"] == BANK for s in shards)
    torch.testing.assert_close(shards[1]["features"].float().norm(dim=1), torch.ones(32), atol=2e-3, rtol=0)
    module = ProjectedBlocks()
    results = dict(score_bank.score(folder, [3, 9], 0.1, ["all"], 2 ** 20))
    one_process = runs[1][0]
    assert hits(results["features"]["top1@k=3"]) == hits(one_process["metrics"]["knn/top1@half,k=3"])
    assert results["block 1"]["top5@k=9"] == one_process["blocks"][2][0]["knn/top5@half,k=9"]
    # another k and temperature than the run's, from the same files
    other = dict(score_bank.score(folder, [4], 0.5, None, 2 ** 20))
    assert set(other) == {"features"}
    assert other["features"]["top1@k=4"] == pytest.approx(reference(module, 4, 0.5, None, 1), abs=1 / QUERIES + 1e-9)


def test_the_command_refuses_an_incomplete_bank_in_one_line(tmp_path, capsys):
    from commands import score_bank

    (tmp_path / "queries.pt").write_bytes(b"")
    (tmp_path / "bank-rank00000-of-00002.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_:
        score_bank.main([str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "1 bank files, not one complete set of ranks" in err
    with pytest.raises(SystemExit):
        score_bank.main([str(tmp_path / "missing")])
    assert capsys.readouterr().err.strip().endswith("missing: no such folder")
