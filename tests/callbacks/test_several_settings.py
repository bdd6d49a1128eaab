"""Every measurement at several settings in one run: kNN at a list of ``k``, each equal to the
single-setting run (the probe's list of rates: test_probe_rates.py); two instances of
every evaluation callback in one Trainer, with their own state keys and metric names; and the
issue's command line (a second kNN on the quickstart) through the CLI."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import seed_everything

from callbacks.measurement.effective_rank import EffectiveRank
from callbacks.measurement.knn import KNNEvaluator, knn_predict_ks
from callbacks.measurement.online_probe import LinearHeads, OnlineLinearProbe
from commands import lightning_cli as cli
from lightning_mods.evaluation import metric_names
from helpers.tiny_runs import Passthrough, TinyData, TinyNet, tiny_trainer

ROOT = Path(__file__).resolve().parents[2]


def numpy_knn_scores(bank: np.ndarray, labels: np.ndarray, queries: np.ndarray, num_classes: int, k: int,
                     temperature: float) -> np.ndarray:
    """The weighted vote in float64 numpy, query by query (ties cannot occur on random points)."""
    bank = bank / np.linalg.norm(bank, axis=1, keepdims=True)
    queries = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    scores = np.zeros((len(queries), num_classes))
    for q, query in enumerate(queries):
        similarity = bank @ query
        for j in np.argsort(-similarity)[:k]:
            scores[q, labels[j]] += np.exp(similarity[j] / temperature)
    return scores


def test_knn_at_several_k_equals_numpy_and_the_single_k_scores():
    g = torch.Generator().manual_seed(0)
    bank, queries = torch.randn(40, 5, generator=g), torch.randn(9, 5, generator=g)
    labels = torch.randint(0, 4, (40,), generator=g)
    ks = [1, 3, 10, 40, 60]  # 60 > bank size: min(k, N), as for one k
    together = knn_predict_ks(bank, labels, queries, 4, ks, temperature=0.5, chunk_size=4)
    for k, scores in zip(ks, together):
        expected = numpy_knn_scores(bank.double().numpy(), labels.numpy(), queries.double().numpy(), 4, min(k, 40), 0.5)
        np.testing.assert_allclose(scores.double().numpy(), expected, rtol=1e-5)
        alone = knn_predict_ks(bank, labels, queries, 4, [k], temperature=0.5, chunk_size=4)[0]
        assert torch.equal(scores, alone), k


def fit_tiny_with(tmp_path, callbacks, module=None, data=None, max_epochs=2):
    seed_everything(0)
    trainer = tiny_trainer(tmp_path, callbacks, max_epochs=max_epochs, limit_train_batches=3)
    trainer.fit(module or TinyNet(), datamodule=data or TinyData())
    return trainer


def test_knn_list_of_k_logs_the_values_of_the_single_k_runs(tmp_path):
    ks = [1, 3, 5, 10]
    together = fit_tiny_with(tmp_path / "all", [KNNEvaluator(k=ks)]).callback_metrics
    assert "knn/top1" not in together  # a list names every value by its k
    for k in ks:
        alone = fit_tiny_with(tmp_path / f"k{k}", [KNNEvaluator(k=k)]).callback_metrics
        assert float(together[f"knn/top1@k={k}"]) == float(alone["knn/top1"]), k
        assert float(together[f"knn/top5@k={k}"]) == float(alone["knn/top5"]) if "knn/top5" in alone else True


def test_two_of_each_callback_share_a_trainer_with_their_own_keys_and_names(tmp_path):
    callbacks = [KNNEvaluator(), KNNEvaluator(k=5, temperature=0.1), OnlineLinearProbe(),
                 OnlineLinearProbe(heads=LinearHeads(lr=0.001), name="slow"), EffectiveRank(),
                 EffectiveRank(source="features")]
    logged = fit_tiny_with(tmp_path, callbacks).callback_metrics
    assert len({cb.state_key for cb in callbacks}) == len(callbacks)
    # the instance at the defaults keeps the plain names: a second kNN leaves the first's column as it was
    expected = {"knn/top1", "knn/top1@k=5,temperature=0.1", "online_probe/val_top1",
                "online_probe/val_top1@slow", "rank/effective_rank", "rank/effective_rank@source=features",
                "rank/entropy", "rank/entropy@source=features"}
    assert expected <= set(logged), expected - set(logged)
    # each is its own measurement: the features' rank is not the covariance rank
    assert float(logged["rank/effective_rank"]) != float(logged["rank/effective_rank@source=features"])
    assert {metric_names.base_name(n) for n in expected} == {"knn/top1", "online_probe/val_top1",
                                                             "rank/effective_rank", "rank/entropy"}


def test_two_instances_that_would_log_the_same_names_are_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match=r"^KNNEvaluator: two instances would log the same names \('near'\); give "
                                         r"each different settings or a distinct 'name'$"):
        fit_tiny_with(tmp_path, [KNNEvaluator(k=5, name="near"), KNNEvaluator(k=10, name="near")])


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    (["--trainer.callbacks+=callbacks.measurement.knn.KNNEvaluator", "--trainer.callbacks.blocks=all"],
     "trainer.callbacks: two KNNEvaluator callbacks have the same settings, so they would measure and save the "
     "same thing (one state_key); give one other settings or a distinct name"),
    (["--trainer.callbacks+=callbacks.measurement.knn.KNNEvaluator"],  # the quickstart's has blocks: all, which adds rows only
     "KNNEvaluator: two instances would log the same names ('plain'); give each different settings or a distinct "
     "'name'"),
])
def test_two_instances_with_the_same_settings_are_a_one_line_cli_error(tmp_path, capsys, extra, message):
    """Lightning refuses two callbacks with one state_key (a traceback); the CLI says it in one line.
    Two that differ only in settings that leave the logged names alike are refused in one line too."""
    with pytest.raises(SystemExit) as exit_info:
        cli.console_main(["fit", "--config=configs/digits_mae.yaml", "--trainer.max_epochs=1",
                          f"--trainer.default_root_dir={tmp_path}", *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"shortcutlab: error: {message}", err


def test_a_checkpoint_keyed_by_the_class_name_restores_into_the_one_instance(tmp_path):
    """Checkpoints written before the keys held settings name the state ``OnlineLinearProbe``."""
    data = TinyData(n_train=96, n_val=30, num_classes=4)
    probe = OnlineLinearProbe(every_n_steps=1)
    trainer = fit_tiny_with(tmp_path / "first", [probe], Passthrough(), data)
    ckpt = tmp_path / "old.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=True)
    state["callbacks"] = {"OnlineLinearProbe": state["callbacks"][probe.state_key]}
    torch.save(state, ckpt)
    restored = OnlineLinearProbe(every_n_steps=1)
    seed_everything(0)
    later = tiny_trainer(tmp_path / "later", [restored], max_epochs=2, limit_train_batches=3)
    later.fit(Passthrough(), datamodule=data, ckpt_path=ckpt)  # max_epochs reached: restores, trains nothing
    assert restored.steps == probe.steps > 0
    for a, b in zip(restored.head.state_dict().values(), probe.head.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, message", [
    ({"k": []}, "KNNEvaluator: k must be an integer >= 1 or a non-empty list of them"),
    ({"k": [5, 5]}, "KNNEvaluator: k lists a value twice"),
    ({"k": [5, 0]}, "KNNEvaluator: k must be an integer >= 1"),
    ({"name": "a@b"}, "KNNEvaluator: name must be a non-empty string without '@' or '/'"),
])
def test_bad_k_lists_and_names(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KNNEvaluator(**kwargs)


@pytest.mark.slow
def test_a_second_knn_on_the_quickstart_through_the_cli(tmp_path):
    """docs/metrics.md's command (Measuring what the shortcut does), with a short budget: a second kNN
    at DINO's four k beside the quickstart's own (the issue tried ``callbacks.measurement.knn.KNNEvaluator``)."""
    readme = (ROOT / "docs" / "metrics.md").read_text()
    command = ("shortcutlab fit --config configs/digits_mae.yaml --trainer.callbacks+=KNNEvaluator "
               "--trainer.callbacks.k=[10,20,100,200]")
    assert command in readme
    budget = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.enable_progress_bar=false",
              f"--trainer.default_root_dir={tmp_path}", "--model.network.depth=2", "--model.network.decoder_depth=1"]
    out = cli.main(command.split()[1:] + budget)
    logged = out.trainer.callback_metrics
    assert len([cb for cb in out.trainer.callbacks if isinstance(cb, KNNEvaluator)]) == 2
    assert {"knn/top1", "knn/top1@k=10", "knn/top1@k=20", "knn/top1@k=100", "knn/top1@k=200"} <= set(logged)
    assert float(logged["knn/top1@k=20"]) == float(logged["knn/top1"])  # the same k, two evaluators
