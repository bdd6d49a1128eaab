"""The evaluation pass the measurement callbacks read: it leaves the module as it found it,
walks the eval-mode submodules as torch does, counts each sample once across ranks, and takes a
few batches under fast_dev_run."""
from __future__ import annotations


import pytest
import torch
from lightning.pytorch import seed_everything
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mods.evaluation._distributed_eval import padding_mask as distributed_padding_mask
from callbacks.measurement.effective_rank import EffectiveRank
from callbacks._utils.feature_collection import collect_features, isolated_eval
from lightning_mods.evaluation._eval_mode import submodules
from callbacks.measurement.knn import KNNEvaluator
from helpers.tiny_runs import Passthrough, TinyData, TinyNet, metric, tiny_trainer


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


def test_fast_dev_run_uses_a_few_batches_and_per_block_needs_blocks(tmp_path):
    from types import SimpleNamespace

    from callbacks._utils.feature_collection import smoke_test_subset

    dataset = TensorDataset(torch.arange(50))
    assert len(smoke_test_subset(SimpleNamespace(fast_dev_run=2), dataset, 8)) == 16
    assert smoke_test_subset(SimpleNamespace(fast_dev_run=False), dataset, 8) is dataset
    trainer = tiny_trainer(tmp_path, [EffectiveRank(per_block=True)], max_epochs=1)
    with pytest.raises(ValueError, match="forward_intermediates"):
        trainer.validate(Passthrough(), datamodule=TinyData(), verbose=False)
