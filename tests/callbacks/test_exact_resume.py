"""Exact resume: a fit stopped at an epoch boundary or mid-epoch and resumed
from its checkpoint ends with the uninterrupted fit's weights, optimiser and scheduler states,
EMA weights and logged metrics, bit for bit on the CPU.

Every fit runs the full length (3 epochs of 4 batches of 32 digits, the cosine schedule's length
is the full run's); the resumed fit starts from a checkpoint written at step ``s`` of an identical fit, or of
a fit that was really interrupted there (an exception after the save).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Checkpoint, EMAWeightAveraging
from lightning.pytorch.loggers import Logger

from callbacks.measurement.effective_rank import EffectiveRank
from callbacks.training.ema import EMA
from callbacks.reliability.exact_resume import ExactResume
from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.online_probe import DepthHeads, LinearHeads, OnlineLinearProbe
from callbacks.settings_key import SettingsKeyed
from callbacks.training.residual_droppath import ResidualDroppath
from datamodules.digits import Digits
from lightning_mods.classifier import ImageClassifier
from lightning_mods.diffusion import DiffusionModule
from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.backbone.resnet import ResNet18Cifar
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.backbone.uvit import UViT

EPOCHS, BATCHES = 3, 4  # limit_train_batches: epochs of 4 of the 44 batches of 32 digits
EPOCH_BOUNDARY, MID_EPOCH = 4, 7  # optimiser steps: end of epoch 0; 3 of 4 batches into epoch 1 (odd)


class Interrupted(Exception):
    pass


class SaveAt(Checkpoint):
    """Write ``step<s>.ckpt`` after optimiser step ``s`` (as ModelCheckpoint does, last in the
    callback order); ``interrupt`` raises right after the save."""

    def __init__(self, dirpath: Path, steps: tuple[int, ...], interrupt: bool = False) -> None:
        self.dirpath, self.steps, self.interrupt = dirpath, steps, interrupt

    def _maybe_save(self, trainer: L.Trainer) -> None:
        if trainer.global_step in self.steps and not (self.dirpath / f"step{trainer.global_step}.ckpt").exists():
            trainer.save_checkpoint(self.dirpath / f"step{trainer.global_step}.ckpt")
            if self.interrupt:
                raise Interrupted

    def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # saved at the epoch's end, as ModelCheckpoint(every_n_epochs) does
        self._maybe_save(trainer)

    def on_train_epoch_end(self, trainer, *args) -> None:  # noqa: ANN001
        self._maybe_save(trainer)


class RecordingLogger(Logger):
    """Every ``log_metrics`` call: ``(step, {name: float})``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.records.append((int(step), {k: float(v) for k, v in metrics.items()}))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def tiny_mae(kind: str) -> MaskedAutoencoder:
    return MaskedAutoencoder(MaskedAutoencoderViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, shortcut=ShortcutSchedule(kind, 0.6) if kind != "learnable" else ShortcutSchedule(kind)), num_reconstructions=0, base_lr=1e-2, warmup_epochs=1)


def tiny_classifier() -> ImageClassifier:
    return ImageClassifier(ResNet18Cifar(num_classes=10, in_chans=1, channels=(4, 4, 4, 4)), num_classes=10,
                           in_chans=1, base_lr=0.5, warmup_epochs=1)


def tiny_diffusion() -> DiffusionModule:
    return DiffusionModule(UViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2, zero_init_branches=False, shortcut={"kind": "linear", "alpha_min": 0.7}), num_sampling_steps=2, num_sample_images=0, warmup_steps=3, lr_schedule="cosine")


CASES: dict[str, tuple[Callable[[], L.LightningModule], Callable[[], list]]] = {
    "mae_linear": (lambda: tiny_mae("linear"), lambda: []),
    "mae_learnable": (lambda: tiny_mae("learnable"), lambda: []),
    "classifier_residual_droppath": (tiny_classifier, lambda: [ResidualDroppath(drop_rate=0.3)]),
    "diffusion_ema": (tiny_diffusion, lambda: [EMA(decay=0.7)]),  # the diffusion configs' EMA
    # two of every stateful evaluation callback, each with its own state and metric names
    "mae_two_of_each_evaluation": (lambda: tiny_mae("linear"), lambda: [
        KNNEvaluator(k=[1, 3]), KNNEvaluator(k=5, temperature=0.1),
        OnlineLinearProbe(heads=LinearHeads(lr=[1e-2, 1e-3]), every_n_steps=1),
        OnlineLinearProbe(heads=LinearHeads(optimizer="sgd"), every_n_steps=2),
        EffectiveRank(), EffectiveRank(source="features", per_block=True, draw_profile=False)]),
    # evaluation over depth: its eval_per_block.csv is rewritten whole from the restored states
    "mae_over_depth": (lambda: tiny_mae("linear"), lambda: [
        KNNEvaluator(blocks="all"), OnlineLinearProbe(every_n_steps=1, depth=DepthHeads([1, -1])),
        EffectiveRank(per_block=True, draw_profile=False)]),
}


def fit(case: str, root: Path, save: Optional[SaveAt] = None, ckpt_path: Optional[Path] = None) -> dict[str, Any]:
    build_module, build_callbacks = CASES[case]
    L.seed_everything(0)  # as the CLI does, also before a resume
    module = build_module()
    extra = build_callbacks()
    logger = RecordingLogger()
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=logger, log_every_n_steps=1,
                        callbacks=[ExactResume(), *extra] + ([save] if save else []),
                        enable_checkpointing=save is not None, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=1, limit_train_batches=BATCHES, limit_val_batches=1,
                        default_root_dir=root)
    trainer.fit(module, Digits(batch_size=32, image_size=8), ckpt_path=ckpt_path)
    ema = next((cb for cb in extra if isinstance(cb, EMAWeightAveraging)), None)
    return {"weights": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "ema": ema._average_model.state_dict() if ema is not None else None,
            "records": logger.records, "global_step": trainer.global_step,
            "callbacks": {cb.state_key: cb.state_dict() for cb in extra if isinstance(cb, SettingsKeyed)},
            "eval_per_block": (root / "eval_per_block.csv").read_text() if (root / "eval_per_block.csv").exists() else None}


def assert_identical(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), f"{where} differs by {(actual.double() - expected.double()).abs().max()}"
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{where}: keys {sorted(set(actual) ^ set(expected))}"
        for key in expected:
            assert_identical(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_identical(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def assert_resumed_equals_full(resumed: dict, full: dict, step: int) -> None:
    assert resumed["global_step"] == full["global_step"] == EPOCHS * BATCHES
    for part in ("weights", "optimizer", "scheduler", "ema", "callbacks", "eval_per_block"):
        assert_identical(resumed[part], full[part], part)
    after = [r for r in full["records"] if r[0] >= step]
    assert len(after) >= 5  # step metrics, epoch metrics, validation metrics
    assert_identical(resumed["records"], after, "logged metrics")


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    runs = {}
    for case in CASES:
        root = tmp_path_factory.mktemp(case)
        runs[case] = fit(case, root, SaveAt(root, (EPOCH_BOUNDARY, MID_EPOCH))), root
    return runs


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("step", [EPOCH_BOUNDARY, MID_EPOCH], ids=["epoch_boundary", "mid_epoch"])
def test_resumed_fit_equals_the_uninterrupted_one(case, step, full_runs, tmp_path):
    full, root = full_runs[case]
    resumed = fit(case, tmp_path, ckpt_path=root / f"step{step}.ckpt")
    assert_resumed_equals_full(resumed, full, step)


def test_really_interrupted_fit_resumes_to_the_uninterrupted_one(full_runs, tmp_path):
    full, _ = full_runs["mae_linear"]
    with pytest.raises(Interrupted):
        fit("mae_linear", tmp_path, SaveAt(tmp_path, (MID_EPOCH,), interrupt=True))
    resumed = fit("mae_linear", tmp_path / "resumed", ckpt_path=tmp_path / f"step{MID_EPOCH}.ckpt")
    assert_resumed_equals_full(resumed, full, MID_EPOCH)


def resume_in_order(root: Path, step: int, seed: int, batch_size: int, monkeypatch) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", str(seed))  # seed_everything sets it; restored after the test
    L.seed_everything(seed)
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, callbacks=[ExactResume()],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_train_batches=BATCHES, limit_val_batches=1,
                        default_root_dir=root)
    trainer.fit(CASES["mae_linear"][0](), Digits(batch_size=batch_size, image_size=8),
                ckpt_path=root.parent / "ckpts" / f"step{step}.ckpt")


@pytest.mark.parametrize("seed, batch_size, message", [
    (1, 32, "--ckpt_path: seed_everything is 1 here and 0 in the checkpoint, which stopped mid-epoch;"),
    (0, 16, "--ckpt_path: data batch_size is 16 here and 32 in the checkpoint, which stopped mid-epoch;"),
])
def test_resume_mid_epoch_in_another_data_order_is_a_one_line_error(seed, batch_size, message, full_runs, tmp_path,
                                                                    monkeypatch):
    """The train position counts batches of the checkpoint's order: another seed or batch size
    would continue another order, skipping or repeating samples."""
    _, root = full_runs["mae_linear"]
    (tmp_path / "ckpts").symlink_to(root)
    with pytest.raises(ValueError) as err:
        resume_in_order(tmp_path / "run", MID_EPOCH, seed, batch_size, monkeypatch)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_resume_at_an_epoch_boundary_in_another_order_warns(full_runs, tmp_path, monkeypatch):
    """Nothing is skipped or repeated from an epoch's start (e.g. a requeue on another GPU count):
    the fit goes on, and says its order is no longer the uninterrupted run's."""
    _, root = full_runs["mae_linear"]
    (tmp_path / "ckpts").symlink_to(root)
    with pytest.warns(UserWarning, match="resuming with data batch_size 16 instead of the checkpoint's 32"):
        resume_in_order(tmp_path / "run", EPOCH_BOUNDARY, 0, 16, monkeypatch)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resumes_mid_epoch_with_the_batches_it_had_left(num_workers):
    from torch.utils.data import DistributedSampler, TensorDataset

    from datamodules.resumable import EpochShuffle, ResumableLoader
    data = TensorDataset(torch.arange(40))
    # the order of an epoch: DistributedSampler's for one replica (Lightning's rule under DDP)
    reference = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    reference.set_epoch(2)
    order = torch.tensor(list(reference)).view(-1, 8)
    loader = ResumableLoader(data, batch_size=8, sampler=EpochShuffle(data, seed=5), num_workers=num_workers)
    loader.sampler.set_epoch(2)
    it = iter(loader)
    assert torch.equal(next(it)[0], order[0]) and torch.equal(next(it)[0], order[1])
    assert loader.position() == {"epoch": 2, "batches": 2}
    resumed = ResumableLoader(data, batch_size=8, sampler=EpochShuffle(data, seed=5), num_workers=num_workers,
                              resume=loader.position())
    assert torch.equal(torch.stack([b[0] for b in resumed]), order[2:])
    assert resumed.position() == {"epoch": 2, "batches": 5}


def test_an_epoch_value_it_cannot_carry_is_named_with_its_reduction(monkeypatch):
    """A logged epoch value reduced with max (not a sum or mean) cannot be carried across a
    mid-epoch checkpoint: the warning names the reduction, not a function's repr."""
    from types import SimpleNamespace

    from callbacks.reliability import exact_resume

    meta = SimpleNamespace(on_epoch=True, reduce_fx=torch.max, is_mean_reduction=False, is_sum_reduction=False,
                           metric_attribute=None)
    results = {"training_step.probe/top1": SimpleNamespace(meta=meta, has_reset=False, is_tensor=True,
                                                           value=torch.tensor(1.0)),
               # logged whole at an epoch's end: nothing to carry mid-epoch, no warning
               "on_train_epoch_end.probe/top5": SimpleNamespace(meta=meta, has_reset=False, is_tensor=True,
                                                                value=torch.tensor(1.0))}
    monkeypatch.setattr(exact_resume.lightning_private, "epoch_results", lambda trainer: results)
    trainer = SimpleNamespace(sanity_checking=False, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(
        batch_progress=SimpleNamespace(is_last_batch=False))))
    with pytest.warns(UserWarning) as said:
        assert exact_resume.epoch_metric_sums(trainer) == {}
    (line,) = [str(w.message) for w in said]
    assert line == ("ExactResume: the epoch value of 'training_step.probe/top1' (reduced with max) will cover "
                    "only the batches after a resume from this mid-epoch checkpoint")
