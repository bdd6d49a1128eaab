"""One feature pass per validation shared by kNN, effective rank (per block) and the online
probe's validation: together they embed the bank and the validation set
once each, and every callback logs what it logs alone."""
from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from callbacks.measurement import shared_features as shared
from callbacks.measurement.effective_rank import EffectiveRank
from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.online_probe import DepthHeads, OnlineLinearProbe
from datamodules.digits import Digits
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.mae import MaskedAutoencoder


class CountingMAE(MaskedAutoencoder):
    """Counts the images its evaluation forwards embed while the trainer validates."""

    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        self.embedded = 0

    def _count(self, images: torch.Tensor) -> None:
        if self._trainer is not None and self.trainer.validating:
            self.embedded += len(images)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        self._count(images)
        return super().forward_features(images)

    def forward_intermediates(self, images: torch.Tensor, indices=None, intermediates_only: bool = False):  # noqa: ANN001, ANN201
        self._count(images)
        return super().forward_intermediates(images, indices, intermediates_only)


def fit_with(callbacks: list, tmp_path) -> tuple[CountingMAE, dict, Digits]:  # noqa: ANN001
    """Two training steps then one validation, from the same seed whatever the callbacks."""
    L.seed_everything(0, verbose=False)
    module = CountingMAE(network=MaskedAutoencoderViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=2,
                                                      num_heads=2, decoder_embed_dim=16, decoder_depth=1,
                                                      decoder_num_heads=2),
                         num_reconstructions=0, base_lr=1e-3, warmup_epochs=0)
    data = Digits(batch_size=64, image_size=8)
    trainer = L.Trainer(max_epochs=1, limit_train_batches=2, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    return module, {k: float(v) for k, v in trainer.callback_metrics.items()}, data


def make_callbacks() -> list:
    return [OnlineLinearProbe(every_n_steps=1, depth=DepthHeads("all")), KNNEvaluator(k=5, blocks="all"),
            EffectiveRank(per_block=True, draw_profile=False)]


def test_three_evaluations_embed_the_bank_and_the_validation_set_once(tmp_path):
    module, together, data = fit_with([*make_callbacks(), shared.SharedEvaluation()], tmp_path / "all")
    assert module.embedded == len(data.bank_dataset) + len(data.val_dataset)
    (pass_,) = [c for c in trainer_of(module).callbacks if isinstance(c, shared.SharedEvaluation)]  # the one listed
    assert pass_._entries == {}  # released when the validation ended
    unlisted, _, _ = fit_with(make_callbacks(), tmp_path / "unlisted")  # none listed: each its own pass, none added
    assert unlisted.embedded > module.embedded
    assert not any(isinstance(c, shared.SharedEvaluation) for c in trainer_of(unlisted).callbacks)
    seen = set()
    for i, callback in enumerate(make_callbacks()):  # each alone: its own passes, the same numbers
        alone_module, alone, _ = fit_with([callback], tmp_path / f"alone{i}")
        names = {k for k in alone if k.startswith(("knn/", "rank/", "online_probe/val"))}
        assert names, alone
        for name in names:
            assert together[name] == alone[name] or (math.isnan(together[name]) and math.isnan(alone[name])), name
        seen |= names
        torch.testing.assert_close(alone_module.state_dict(), module.state_dict(), rtol=0, atol=0)
    assert {"knn/top1", "rank/effective_rank", "online_probe/val_top1"} <= seen


def trainer_of(module):  # noqa: ANN001, ANN201
    return module.trainer


class StubTrainer:
    """What the shared pass reads of a Trainer."""

    def __init__(self, dataset) -> None:  # noqa: ANN001
        import contextlib

        self.state, self.sanity_checking, self.global_step, self.current_epoch = SimpleNamespace(fn="fit"), False, 3, 0
        self.precision_plugin = SimpleNamespace(forward_context=contextlib.nullcontext, precision="32")
        self.datamodule, self.fast_dev_run = SimpleNamespace(val_dataset=dataset), False
        self.callbacks, self.strategy = [], SimpleNamespace(world_size=1)


class Embedder(torch.nn.Module):
    """forward_features = a linear map; counts calls."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.calls = 0

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(images)


def test_a_changed_weight_or_step_is_never_served_stale_features():
    dataset = torch.utils.data.TensorDataset(torch.randn(10, 4), torch.arange(10) % 3)
    module = Embedder()
    trainer = StubTrainer(dataset)
    trainer.callbacks.append(shared.SharedEvaluation())
    evaluation = shared.SharedEvaluation.of(trainer)
    assert trainer.callbacks == [evaluation] and shared.SharedEvaluation.of(trainer) is evaluation
    first = evaluation.features(trainer, module, "val_dataset", "test", 4, 0)
    again = evaluation.features(trainer, module, "val_dataset", "test", 4, 0, gather=False)
    assert module.calls == 3 and again.features is not None  # 3 batches of 4, once
    with torch.no_grad():
        module.linear.weight.add_(1.0)  # an in-place change (an optimiser step, an EMA swap)
    changed = evaluation.features(trainer, module, "val_dataset", "test", 4, 0)
    assert module.calls == 6
    with torch.no_grad():
        torch.testing.assert_close(changed.features, module.linear(dataset.tensors[0]))
        assert not torch.allclose(first.features, changed.features)
    trainer.global_step = 4
    evaluation.features(trainer, module, "val_dataset", "test", 4, 0)
    assert module.calls == 9
    evaluation.features(trainer, module, "val_dataset", "test", 5, 0)  # another batch size: its own pass
    assert module.calls == 11
    evaluation.release()
    evaluation.features(trainer, module, "val_dataset", "test", 4, 0)
    assert module.calls == 14
    alone = shared.SharedEvaluation.of(StubTrainer(dataset))  # none listed: a pass that keeps nothing
    alone.features(trainer, module, "val_dataset", "test", 4, 0)
    alone.features(trainer, module, "val_dataset", "test", 4, 0)
    assert module.calls == 20 and alone._entries == {}

