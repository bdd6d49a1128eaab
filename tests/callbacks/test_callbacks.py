"""The evaluation callbacks (callbacks/): kNN, effective rank, feature collection, online probe,
run summary; each checked against an independent reference (hand-computed values, numpy,
the run without the callback)."""
from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mods.evaluation.distributed_eval import padding_mask as distributed_padding_mask
from callbacks.measurement.effective_rank import (EffectiveRank, effective_rank, entropy, rank_measures, read_profiles,
                                     singular_values)
from callbacks._utils.feature_collection import collect_features, isolated_eval
from lightning_mods.evaluation.eval_mode import submodules
from callbacks.measurement.knn import KNNEvaluator, knn_classify, knn_predict, topk_correct
from callbacks.measurement.online_probe import OnlineLinearProbe
from callbacks.reporting.run_summary import RunSummary, format_value

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")


# --- tiny module and data following docs/contracts.md -------------------------------------
class TinyNet(LightningModule):
    """Encoder with BatchNorm and dropout, trained to reconstruct noisy inputs: every training
    step draws from the global RNG (noise, dropout), like MAE masking."""

    def __init__(self, in_dim: int = 6, width: int = 12, dropout: float = 0.2, noise: float = 0.3,
                 lr: float = 0.05) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(nn.Linear(in_dim, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(dropout))
        self.layer2 = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU())
        self.decoder = nn.Linear(width, in_dim)
        self.num_features = width
        self.noise, self.lr = noise, lr

    def forward_intermediates(self, x: torch.Tensor, indices=None, intermediates_only: bool = False):  # noqa: ANN001
        """A user's own module meets the feature contract with timm's call and nothing of ours."""
        h1 = self.layer1(x)
        blocks = [h1, self.layer2(h1)]
        picked = blocks if indices is None else [blocks[i] for i in indices]
        return picked if intermediates_only else (blocks[-1], picked)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_intermediates(x, intermediates_only=True)[-1]

    def training_step(self, batch, batch_idx):
        x = batch[0]
        loss = ((self.decoder(self.forward_features(x + self.noise * torch.randn_like(x))) - x) ** 2).mean()
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", ((self.decoder(self.forward_features(batch[0])) - batch[0]) ** 2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def class_blobs(n: int, num_classes: int, dim: int, seed: int, spread: float = 0.3):
    """``n`` points around ``num_classes`` fixed random centres (the same centres for every seed)."""
    centres = torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(1234)) * 2
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % num_classes
    return centres[labels] + spread * torch.randn(n, dim, generator=g), labels


class TinyData(LightningDataModule):
    """``bank_dataset`` = ``train_dataset`` (no augmentation), ``val_dataset`` held out."""

    def __init__(self, n_train: int = 48, n_val: int = 21, num_classes: int = 3, dim: int = 6,
                 batch_size: int = 8, shuffle: bool = True, spread: float = 0.3) -> None:
        super().__init__()
        self.num_classes, self.batch_size, self.num_workers, self.shuffle = num_classes, batch_size, 0, shuffle
        self.train_dataset = self.bank_dataset = TensorDataset(*class_blobs(n_train, num_classes, dim, 0, spread))
        self.val_dataset = TensorDataset(*class_blobs(n_val, num_classes, dim, 1, spread))

    def train_dataloader(self):
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_dataset, batch_size=self.batch_size)


def tiny_trainer(tmp_path, callbacks, max_epochs=2, **kwargs) -> Trainer:
    defaults = dict(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                    num_sanity_val_steps=2, log_every_n_steps=1)
    defaults.update(kwargs)
    return Trainer(callbacks=callbacks, **defaults)


def metric(trainer: Trainer, name: str) -> float:
    return float(trainer.callback_metrics[name])


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


# --- feature collection leaves the module untouched ---------------------------------------
def test_feature_collection_leaves_module_untouched():
    seed_everything(0)
    model, data = TinyNet(), TinyData()
    model.train()
    model.layer1[3].eval()  # a sub-module deliberately in eval stays so
    # give batch norm non-trivial running statistics first
    with torch.no_grad():
        for _ in range(3):
            model.forward_features(data.train_dataset.tensors[0][:8] * 3 + 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_before = torch.get_rng_state()
    got = collect_features(model, data.val_dataset, batch_size=4, with_blocks=True)
    assert torch.equal(torch.get_rng_state(), rng_before)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.training and model.layer1[0].training and not model.layer1[3].training
    # features: eval-mode forward in dataset order, labels aligned
    x, y = data.val_dataset.tensors
    with isolated_eval(model):
        expected = model.forward_intermediates(x, intermediates_only=True)
    torch.testing.assert_close(got.features, expected[-1])
    torch.testing.assert_close(got.blocks[0], expected[0])
    assert torch.equal(got.labels, y)
    # kNN evaluation through a trainer leaves the weights and BN statistics alone too
    trainer = tiny_trainer(None, [KNNEvaluator(k=5)], max_epochs=1)
    trainer.validate(model, datamodule=data, verbose=False)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert 0.0 <= metric(trainer, "knn/top1") <= 1.0


def test_isolated_eval_walks_every_submodule_once_as_torch_does():
    shared = nn.Linear(2, 2)
    inner = nn.Sequential(shared, nn.Dropout(0.5), nn.Sequential(nn.BatchNorm1d(2)))
    model = nn.Sequential(inner, shared, nn.Sequential(inner))
    model.register_module("absent", None)
    assert [id(m) for m in submodules(model)] == [id(m) for m in model.modules()]
    model.train()
    inner[1].eval()  # a sub-module deliberately in eval stays so
    before = [m.training for m in model.modules()]
    with isolated_eval(model):
        assert not any(m.training for m in model.modules())
        assert not torch.is_grad_enabled()
    assert [m.training for m in model.modules()] == before


def test_distributed_padding_mask_keeps_each_sample_once():
    dataset = TensorDataset(torch.arange(7))
    seen = []
    for rank in range(3):
        sampler = DistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=True, seed=5)
        loader = DataLoader(dataset, batch_size=2, sampler=sampler)
        start = 0
        for (batch,) in loader:
            real = distributed_padding_mask(loader, start, len(batch))
            seen += batch[real].tolist()
            start += len(batch)
    assert sorted(seen) == list(range(7))
    assert distributed_padding_mask(DataLoader(dataset), 0, 1) is None


# --- training with the callbacks ----------------------------------------------------------
class RecordGrads(Callback):
    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append([p.grad.clone() for p in pl_module.parameters()])


def fit_tiny(tmp_path, extra_callbacks, max_epochs=2, **trainer_kwargs):
    seed_everything(0)
    model, data, recorder = TinyNet(), TinyData(), RecordGrads()
    trainer = tiny_trainer(tmp_path, [recorder, *extra_callbacks], max_epochs=max_epochs, limit_train_batches=3,
                           **trainer_kwargs)
    trainer.fit(model, datamodule=data)
    return model, recorder.grads, trainer


def test_callbacks_do_not_change_pretraining(tmp_path):
    plain, plain_grads, _ = fit_tiny(tmp_path / "plain", [])
    probe = OnlineLinearProbe()
    watched, watched_grads, trainer = fit_tiny(
        tmp_path / "watched", [probe, KNNEvaluator(k=5), EffectiveRank(per_block=True)])
    assert len(plain_grads) == len(watched_grads) == 6
    for step_plain, step_watched in zip(plain_grads, watched_grads):
        for a, b in zip(step_plain, step_watched):
            assert torch.equal(a, b)
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        assert torch.equal(a, b), name
    assert probe.steps == 2  # batches 0 and 4 of 6 (every_n_steps=4)
    for name in ("knn/top1", "online_probe/val_top1", "rank/effective_rank", "rank/entropy"):
        assert name in trainer.callback_metrics, name
    assert not [name for name in trainer.callback_metrics if name.startswith("rank/block")]  # a file, not metrics


class Passthrough(LightningModule):
    """Features = the inputs; a dummy loss so that ``fit`` runs."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.num_features = 6

    def forward_features(self, x):
        return x

    def training_step(self, batch, batch_idx):
        return (self.scale - 1.0) ** 2

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_online_probe_learns_separable_data(tmp_path):
    seed_everything(0)
    probe = OnlineLinearProbe(lr=0.05, every_n_steps=1, max_samples=None)
    data = TinyData(n_train=96, n_val=30, num_classes=4, spread=0.2)
    trainer = tiny_trainer(tmp_path, [probe], max_epochs=4)
    trainer.fit(Passthrough(), datamodule=data)
    assert metric(trainer, "online_probe/val_top1") >= 0.95
    assert metric(trainer, "online_probe/train_top1") >= 0.8
    # the logged accuracy is the head's accuracy on the validation set
    x, y = data.val_dataset.tensors
    probe.head.eval()
    with torch.no_grad():
        acc = (probe.head(x).argmax(1) == y).float().mean().item()
    assert metric(trainer, "online_probe/val_top1") == pytest.approx(acc)


def test_online_probe_state_dict_round_trip():
    probe = OnlineLinearProbe(num_classes=3, feature_dim=4, optimizer="sgd")
    probe.build_heads(4)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    probe.probe_heads.learn(x, y, {})
    assert probe.steps == 1
    state = probe.state_dict()
    other = OnlineLinearProbe(num_classes=3, feature_dim=4, optimizer="sgd", seed=7)
    other.load_state_dict(state)  # before setup: applied when the head is built
    other.build_heads(4)
    for a, b in zip(probe.head.state_dict().values(), other.head.state_dict().values()):
        assert torch.equal(a, b)
    assert str(other.optimizer.state_dict()) == str(probe.optimizer.state_dict())
    with pytest.raises(ValueError, match="optimizer"):
        OnlineLinearProbe(optimizer="lamb")


def test_online_probe_refuses_a_head_trained_at_another_default_rate():
    """A single head's rate is in its state: when the default rate moves (1e-2 -> 2e-2), a
    checkpoint of the old default does not go on silently at the new one."""
    probe = OnlineLinearProbe(num_classes=3, feature_dim=4, lr=0.01)
    probe.build_heads(4)
    state = probe.state_dict()
    assert [h["lr"] for h in state["heads"]] == [0.01]
    default = OnlineLinearProbe(num_classes=3, feature_dim=4)
    assert default.lr == 0.02
    default.load_state_dict(state)
    with pytest.raises(ValueError, match=r"trained at lr \[0.01\], this probe's are \[0.02\]"):
        default.build_heads(4)
    # a single head's earlier layout, written before the rate was saved
    older = {**{k: v for k, v in state.items() if k != "heads"}, "head": state["heads"][0]["head"],
             "optimizer": state["heads"][0]["optimizer"]}
    continued = OnlineLinearProbe(num_classes=3, feature_dim=4)
    continued.load_state_dict(older)
    continued.build_heads(4)  # no rate saved: taken to be this probe's
    assert torch.equal(continued.head.linear.weight, probe.head.linear.weight)


def test_resume_continues_exactly(tmp_path):
    def run(max_epochs, ckpt_path=None, root="run"):
        seed_everything(0)
        model, data = TinyNet(dropout=0.0, noise=0.0), TinyData(shuffle=False)
        callbacks = [OnlineLinearProbe(), KNNEvaluator(k=5), EffectiveRank(), ModelCheckpoint(dirpath=tmp_path / root)]
        trainer = tiny_trainer(tmp_path, callbacks, max_epochs=max_epochs, enable_checkpointing=True,
                               limit_train_batches=3)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return model, callbacks, trainer

    straight, straight_cbs, _ = run(3, root="straight")
    _, _, first = run(1, root="first")
    resumed, resumed_cbs, trainer = run(3, ckpt_path=first.checkpoint_callback.best_model_path, root="resumed")
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    probe_a, probe_b = straight_cbs[0], resumed_cbs[0]
    assert probe_a.steps == probe_b.steps == 3  # batches 0, 4, 8: the cadence continues across the resume
    for a, b in zip(probe_a.head.state_dict().values(), probe_b.head.state_dict().values()):
        assert torch.equal(a, b)
    assert straight_cbs[1].state_dict() == resumed_cbs[1].state_dict()
    assert [h["epoch"] for h in resumed_cbs[2].history] == [0, 1, 2]  # epoch 0 came from the checkpoint
    assert resumed_cbs[2].history == straight_cbs[2].history


def test_evaluation_schedule_and_picture(tmp_path):
    seed_everything(0)
    rank_cb = EffectiveRank(every_n_epochs=2, per_block=True)
    knn_cb = KNNEvaluator(k=5, every_n_epochs=2)
    trainer = tiny_trainer(tmp_path, [rank_cb, knn_cb], max_epochs=5, limit_train_batches=1,
                           logger=True, default_root_dir=tmp_path)
    trainer.fit(TinyNet(), datamodule=TinyData())
    assert [h["epoch"] for h in rank_cb.history] == [1, 3, 4]  # every 2nd epoch and the last
    assert knn_cb.last_epoch == 4
    pictures = sorted(p.name for p in (tmp_path / "lightning_logs" / "version_0" / "pictures").glob("*.png"))
    assert pictures == ["rank_profile_step0000002.png", "rank_profile_step0000004.png",
                        "rank_profile_step0000005.png"]
    assert len(rank_cb.history[-1]["profile"]) == 2
    profiles = read_profiles(tmp_path / "lightning_logs" / "version_0" / "rank_per_block.csv")
    assert list(profiles) == [1, 3, 4]
    for entry in rank_cb.history:
        assert profiles[entry["epoch"]] == {"entropy": entry["entropy_profile"], "effective_rank": entry["profile"]}


class HandBuiltBlocks(Passthrough):
    """Block 1: the inputs; block 2: their first coordinate only (rank one)."""

    def forward_intermediates(self, x, indices=None, intermediates_only=False):  # noqa: ANN001
        blocks = [x, x * torch.tensor([1.0, 0, 0, 0, 0, 0])]
        return blocks if intermediates_only else (self.forward_features(x), blocks)


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


def test_run_summary_shows_accuracies_as_the_logged_fractions():
    assert format_value("knn/top1", 0.48611) == "0.4861"
    assert format_value("online_probe/val_top1", 1.0) == "1.0000"
    assert format_value("val/top5", 0.125) == "0.1250"
    assert format_value("rank/effective_rank", 31.3912) == "31.39"
    assert format_value("val/loss", 0.000123456) == "0.0001235"
    assert format_value("knn/top1", None) == "-"


class RecordValidationEpochs(Callback):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.epochs.append(int(trainer.current_epoch))


class RecordingKNN(KNNEvaluator):
    """KNNEvaluator that records the epochs it evaluated at."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.evaluated: list[int] = []

    def evaluate(self, trainer, pl_module):
        self.evaluated.append(int(trainer.current_epoch))
        return super().evaluate(trainer, pl_module)


def test_evaluation_follows_the_validation_cadence_and_the_last_epoch(tmp_path):
    """max_epochs 5, check_val_every_n_epoch 2: Lightning alone validates after epochs 2 and 4
    (1-indexed); the evaluation callbacks add epoch 5, the last, so a short run reports values.
    every_n_epochs None evaluates at each of these validations; an explicit 4 at epoch 4 and 5."""
    seed_everything(0)
    follow, knn, every_4 = EffectiveRank(), KNNEvaluator(k=5), RecordingKNN(k=5, every_n_epochs=4)
    validations = RecordValidationEpochs()
    trainer = tiny_trainer(tmp_path, [follow, knn, every_4, validations], max_epochs=5, limit_train_batches=1,
                           check_val_every_n_epoch=2)
    trainer.fit(TinyNet(), datamodule=TinyData())
    assert validations.epochs == [1, 3, 4]  # 0-indexed: epochs 2, 4 and 5
    assert [h["epoch"] for h in follow.history] == [1, 3, 4]
    assert knn.last_epoch == 4 and 0 <= metric(trainer, "knn/top1") <= 1
    assert every_4.evaluated == [3, 4]
    assert trainer.check_val_every_n_epoch == 2  # the trainer's setting is back after the last epoch


def test_last_epoch_on_the_cadence_is_not_validated_twice(tmp_path):
    seed_everything(0)
    follow, validations = EffectiveRank(), RecordValidationEpochs()
    trainer = tiny_trainer(tmp_path, [follow, validations], max_epochs=4, limit_train_batches=1,
                           check_val_every_n_epoch=2)
    trainer.fit(TinyNet(), datamodule=TinyData())
    assert validations.epochs == [1, 3] and [h["epoch"] for h in follow.history] == [1, 3]


def test_every_n_epochs_accepts_none_and_positive_ints_only():
    assert EffectiveRank().every_n_epochs is None and KNNEvaluator(every_n_epochs=3).every_n_epochs == 3
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="every_n_epochs must be an integer >= 1 or null"):
            EffectiveRank(every_n_epochs=bad)


def test_run_summary_table_and_file(tmp_path, capsys):
    seed_everything(0)
    summary = RunSummary()
    trainer = tiny_trainer(tmp_path, [OnlineLinearProbe(), KNNEvaluator(k=5), EffectiveRank(), summary,
                                      ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)],
                           max_epochs=1, limit_train_batches=2, enable_checkpointing=True)
    trainer.fit(TinyNet(), datamodule=TinyData())
    out = capsys.readouterr().out
    for text in ("knn/top1", "online_probe/val_top1", "rank/effective_rank", "last checkpoint", "last.ckpt"):
        assert text in out, text
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["metrics"]["knn/top1"] == pytest.approx(metric(trainer, "knn/top1"))
    assert written["last_checkpoint"].endswith("last.ckpt")
    assert written["epochs"] == 1 and written["steps"] == 2


def test_run_summary_paths_stay_whole_in_a_log_file(tmp_path, capsys):
    """Not a terminal (a job's log file): each path on one line, copyable, however long."""
    deep = tmp_path / ("a_rather_long_folder_name_" * 4) / "checkpoints"
    summary = RunSummary()
    summary.summary = {"metrics": {"knn/top1": 0.5}, "best_checkpoint": str(deep / "epoch=9-step=100.ckpt"),
                       "last_checkpoint": str(deep / "last.ckpt"), "pictures": None, "log_dir": str(tmp_path),
                       "epochs": 10, "steps": 100}
    summary.print_table()
    lines = capsys.readouterr().out.splitlines()
    for path in (deep / "last.ckpt", deep / "epoch=9-step=100.ckpt"):
        assert any(str(path) in line for line in lines), (str(path), lines)


def test_fast_dev_run_uses_a_few_batches_and_per_block_needs_blocks(tmp_path):
    from types import SimpleNamespace

    from callbacks._utils.feature_collection import smoke_test_subset

    dataset = TensorDataset(torch.arange(50))
    assert len(smoke_test_subset(SimpleNamespace(fast_dev_run=2), dataset, 8)) == 16
    assert smoke_test_subset(SimpleNamespace(fast_dev_run=False), dataset, 8) is dataset
    trainer = tiny_trainer(tmp_path, [EffectiveRank(per_block=True)], max_epochs=1)
    with pytest.raises(ValueError, match="forward_intermediates"):
        trainer.validate(Passthrough(), datamodule=TinyData(), verbose=False)


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


def test_online_probe_accuracies_on_a_hand_built_case():
    """An identity head on one-hot features predicts the hot index. Validation as rank 1 of 2 over
    5 samples: it holds samples 1 (hit), 3 (miss) and sample 0 again as padding (a hit that must
    not count), so val_top1 = 1/2 exactly (2/3 if the padding counted)."""
    import contextlib
    from types import SimpleNamespace

    probe = OnlineLinearProbe(num_classes=3, feature_dim=3, batch_norm=False, every_n_steps=1)
    probe.build_heads(3)
    with torch.no_grad():
        probe.head.linear.weight.copy_(torch.eye(3))
        probe.head.linear.bias.zero_()
    features = torch.eye(3)[[0, 1, 2, 2, 0]]  # predictions 0, 1, 2, 2, 0
    labels = torch.tensor([0, 1, 0, 0, 1])
    module, logged = Passthrough(), {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, float(value))
    module.log_dict = lambda values, **kwargs: logged.update({k: float(v) for k, v in values.items()})
    dataset = TensorDataset(features, labels)
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2, rank=1,
                                                                          shuffle=False))
    trainer = SimpleNamespace(sanity_checking=False, val_dataloaders=loader,
                              precision_plugin=SimpleNamespace(forward_context=contextlib.nullcontext))

    probe.on_train_batch_end(trainer, module, None, (features[:4], labels[:4]), 0)
    probe.on_train_epoch_end(trainer, module)
    assert logged["online_probe/train_top1"] == 0.5  # hits on samples 0 and 1 of 4, before the step
    with torch.no_grad():  # back to the identity head the step moved
        probe.head.linear.weight.copy_(torch.eye(3))
        probe.head.linear.bias.zero_()
    probe.on_validation_epoch_start(trainer, module)
    for i, batch in enumerate(loader):
        probe.on_validation_batch_end(trainer, module, None, batch, i)
    probe.on_validation_epoch_end(trainer, module)
    assert logged["online_probe/val_top1"] == 0.5
