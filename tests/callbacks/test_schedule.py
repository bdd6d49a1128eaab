"""When the evaluation callbacks run (callbacks.schedule): every n-th epoch and the last, the
validation cadence, no second validation of the last epoch, and the every_n_epochs checks."""
from __future__ import annotations


import pytest
from lightning.pytorch import Callback, seed_everything

from callbacks.measurement.effective_rank import EffectiveRank, read_profiles
from callbacks.measurement.knn import KNNEvaluator
from helpers.tiny_runs import TinyData, TinyNet, metric, tiny_trainer


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


def test_a_fit_ended_by_max_steps_mid_epoch_is_validated_and_evaluated_at_its_end(tmp_path):
    """6 batches an epoch, max_steps 9: Lightning alone stops in the second epoch's middle without
    a validation (the run summary would show no numbers); the fit is validated and evaluated at
    step 9, as a fit ended by max_epochs is at its last epoch, and the cadence is the trainer's again."""
    seed_everything(0)
    follow, knn, validations = EffectiveRank(), RecordingKNN(k=5, every_n_epochs=4), RecordValidationEpochs()
    steps = []

    class RecordSteps(Callback):
        def on_validation_epoch_end(self, trainer, pl_module) -> None:
            if not trainer.sanity_checking:
                steps.append(int(trainer.global_step))
    trainer = tiny_trainer(tmp_path, [follow, knn, validations, RecordSteps()], max_epochs=-1, max_steps=9,
                           check_val_every_n_epoch=3)
    trainer.fit(TinyNet(), datamodule=TinyData())
    assert trainer.global_step == 9 and validations.epochs == [1] and steps == [9]
    assert [h["epoch"] for h in follow.history] == [1] and knn.evaluated == [1]
    assert 0 <= metric(trainer, "knn/top1") <= 1
    assert trainer.check_val_every_n_epoch == 3


def test_every_n_epochs_accepts_none_and_positive_ints_only():
    assert EffectiveRank().every_n_epochs is None and KNNEvaluator(every_n_epochs=3).every_n_epochs == 3
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="every_n_epochs must be an integer >= 1 or null"):
            EffectiveRank(every_n_epochs=bad)
