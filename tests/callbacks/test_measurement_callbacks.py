"""The measurement callbacks together: they do not change the pre-training (gradients and
weights equal to the run without them), and a resumed run equals the uninterrupted one."""
from __future__ import annotations


import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks.measurement.effective_rank import EffectiveRank
from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.online_probe import OnlineLinearProbe
from helpers.tiny_runs import TinyData, TinyNet, fit_tiny, tiny_trainer


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
