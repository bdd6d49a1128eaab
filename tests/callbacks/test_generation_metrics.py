"""GenerationMetrics: FID/KID/IS of the EMA model's samples against the datamodule's reference
(a registered tiny extractor, no downloads), the reference cache and its name, ``validate`` from a
checkpoint, and the checkpoint chosen by FID then reported with more samples (U-ViT's protocol)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging

from commands import lightning_cli as cli
from callbacks.measurement.fid import GenerationMetrics, reference_fingerprint
from datamodules.digits import Digits
from lightning_mods.diffusion import DiffusionModule
from helpers.tiny_feature_extractor import register_tiny_extractor
from lightning_mods.backbone.uvit import UViT

TINY_EXTRACTOR = register_tiny_extractor()
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_diffusion_quick.yaml"




class RecordGeneration(Callback):
    def setup(self, trainer, pl_module, stage):
        original = pl_module.generate_images
        self.weights = []

        def recording(*args, **kwargs):
            self.weights.append([p.detach().clone() for p in pl_module.parameters()])
            return original(*args, **kwargs)

        pl_module.generate_images = recording


def test_callback_measures_ema_samples_against_the_datamodule(tmp_path):
    torch.manual_seed(0)
    module = DiffusionModule(UViT(img_size=8, in_chans=1, patch_size=2, embed_dim=32, depth=2, num_heads=4, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}), num_sampling_steps=2, num_sample_images=0, lr=1e-2, warmup_steps=0)
    metrics = GenerationMetrics(num_samples=24, batch_size=10, every_n_epochs=1, feature_extractor=TINY_EXTRACTOR,
                                kid_subset_size=10, cache_root=str(tmp_path / "cache"))
    ema, record = EMAWeightAveraging(decay=0.5), RecordGeneration()
    # the metrics callback is listed FIRST: it must still see the EMA weights
    trainer = Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, accelerator="cpu", logger=False,
                      callbacks=[metrics, record, ema], enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=Digits(batch_size=16, image_size=8))
    logged = trainer.callback_metrics
    assert np.isfinite(logged["val/fid"].item()) and logged["val/fid"].item() > 0
    assert {"val/kid_mean", "val/isc_mean"} <= set(logged)
    assert len(record.weights) == 3  # batches of 10, 10 and 4
    averaged = list(ema._average_model.module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(record.weights[0], averaged))
    assert len(list((tmp_path / "cache").glob(f"Digits-train-8px-n1437-*-{TINY_EXTRACTOR}-stat-fid-pool.pt"))) == 1


def test_reference_cache_name_tells_apart_references_with_other_pixels():
    callback = GenerationMetrics(reference_split="val", num_reference=50)
    trainer = type("T", (), {"datamodule": None})()
    module = type("Pixels", (), {"is_latent": False})()

    def name(**kwargs) -> str:
        callback.reference = Digits(image_size=8, **kwargs)
        return callback.reference_images(trainer, module)[1]

    base = name()
    assert base.startswith("Digits-val-8px-n50-")
    assert name(batch_size=7, num_workers=1) == base  # how images are loaded does not matter
    callback.num_reference = 60
    assert name() != base  # another subset


def test_reference_fingerprint_follows_the_settings_that_decide_the_pixels():
    def fingerprint(**changes) -> str:
        hparams = {"data_dir": "/data/imagenet", "class_list": "in100.txt", "image_size": 64,
                   "eval_crop_ratio": 0.875, "batch_size": 64, "num_workers": 8}
        return reference_fingerprint(type("DM", (), {"hparams": {**hparams, **changes}})(), [0, 3, 5])

    base = fingerprint()
    assert len(base) == 8 and fingerprint(batch_size=256, num_workers=0) == base
    for changes in ({"data_dir": "/data/other"}, {"class_list": None}, {"eval_crop_ratio": 1.0}):
        assert fingerprint(**changes) != base, changes
    assert reference_fingerprint(type("DM", (), {"hparams": {}})(), [0, 3]) != \
        reference_fingerprint(type("DM", (), {"hparams": {}})(), [0, 4])


def test_latent_model_needs_an_image_reference(tmp_path):
    module = type("Latent", (), {"is_latent": True})()
    trainer = type("T", (), {"datamodule": None})()
    with pytest.raises(ValueError, match="reference"):
        GenerationMetrics().reference_images(trainer, module)
    with pytest.raises(ValueError, match="num_samples"):
        GenerationMetrics(num_samples=0)


@pytest.mark.slow
def test_cli_validate_from_a_checkpoint_computes_fid_with_the_cached_reference(tmp_path):
    callback = {"class_path": "callbacks.measurement.fid.GenerationMetrics",
                "init_args": {"num_samples": 12, "batch_size": 12, "every_n_epochs": 1, "kid_subset_size": 10,
                              "feature_extractor": TINY_EXTRACTOR, "cache_root": str(tmp_path / "cache"),
                              "reference_split": "val", "num_reference": 50}}
    args = ["--config", str(CONFIG), "--trainer.limit_train_batches=1", "--trainer.max_epochs=1",
            "--trainer.limit_val_batches=1", "--trainer.check_val_every_n_epoch=1", "--trainer.accelerator=cpu",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
            f"--trainer.callbacks+={json.dumps(callback)}",
            "--model.init_args.num_sampling_steps=2", "--model.init_args.num_sample_images=0"]
    fitted = cli.main(["fit", *args])
    assert "val/fid" in fitted.trainer.callback_metrics
    image_size = yaml.safe_load(CONFIG.read_text())["data"]["init_args"]["image_size"]
    [stats] = (tmp_path / "cache").glob(f"Digits-val-{image_size}px-n50-*-{TINY_EXTRACTOR}-stat-fid-pool.pt")
    stamp = stats.stat().st_mtime_ns
    validated = cli.main(["validate", *args, "--ckpt_path", fitted.trainer.checkpoint_callback.last_model_path])
    fid = validated.trainer.callback_metrics["val/fid"].item()
    assert np.isfinite(fid)
    # same EMA weights, same seeds: the same samples and the same FID as at the end of fit
    assert fid == pytest.approx(fitted.trainer.callback_metrics["val/fid"].item(), rel=1e-6)
    assert stats.stat().st_mtime_ns == stamp


class RecordFid(Callback):
    """(global step, val/fid) at the end of every validation of ``fit``."""

    def __init__(self, metrics: GenerationMetrics) -> None:
        self.metrics, self.history = metrics, []

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "fit":
            self.history.append((trainer.global_step, self.metrics.last_metrics["fid"]))


def test_checkpoint_choice_by_fid_then_report_with_more_samples(tmp_path):
    """U-ViT's protocol in small: a checkpoint and a cheap FID every 2 steps, the best kept by
    ModelCheckpoint(monitor=val/fid), then ``validate`` of that checkpoint with the report settings."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    module = DiffusionModule(UViT(img_size=8, in_chans=1, patch_size=2, embed_dim=16, depth=2, num_heads=2, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}), num_sampling_steps=2, num_sample_images=0, lr=3e-2, warmup_steps=0)
    fid_kwargs = dict(num_samples=12, batch_size=12, every_n_epochs=1, feature_extractor=TINY_EXTRACTOR,
                      kid=False, isc=False, cache_root=str(tmp_path / "cache"), reference_split="val",
                      num_reference=40)
    metrics = GenerationMetrics(**fid_kwargs, report_num_samples=20, report_num_sampling_steps=3)
    record = RecordFid(metrics)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="val/fid", mode="min", save_top_k=-1,
                                  save_last="link", filename="step{step}-fid10k{val/fid:.4f}",
                                  auto_insert_metric_name=False)
    data = Digits(batch_size=16, image_size=8)
    common = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=1, default_root_dir=tmp_path)
    trainer = Trainer(max_steps=6, val_check_interval=2, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                      callbacks=[metrics, record, checkpoints], **common)
    trainer.fit(module, datamodule=data)
    steps = [s for s, _ in record.history]
    assert steps == [2, 4, 6]
    best_step, best_fid = min(record.history, key=lambda pair: pair[1])
    assert Path(checkpoints.best_model_path).name == f"step{best_step}-fid10k{best_fid:.4f}.ckpt"
    assert len(list((tmp_path / "ckpts").glob("step*-fid10k*.ckpt"))) == 3
    assert Path(checkpoints.last_model_path).is_symlink()  # save_last: link, no extra copy

    class CountSamples(Callback):
        def on_validation_start(self, trainer, pl_module):
            original, self.calls = DiffusionModule.generate_images.__get__(pl_module), []

            def counting(n, labels=None, seed=0, sampler=None, num_steps=None, guidance_scale=None):
                self.calls.append((n, sampler, num_steps))
                return original(n, labels, seed=seed, sampler=sampler, num_steps=num_steps,
                                guidance_scale=guidance_scale)

            pl_module.generate_images = counting

    # the best checkpoint holds the weights that were scored: the same FID with the fit settings
    count = CountSamples()
    again = Trainer(callbacks=[GenerationMetrics(**fid_kwargs), count], **common)
    again.validate(module, datamodule=data, ckpt_path=checkpoints.best_model_path)
    assert again.callback_metrics["val/fid"].item() == pytest.approx(best_fid, rel=1e-5)
    assert count.calls == [(12, None, None)]  # the model's own sampler and steps
    report = Trainer(callbacks=[metrics, count], **common)
    report.validate(module, datamodule=data, ckpt_path=checkpoints.best_model_path)
    assert count.calls == [(12, None, 3), (8, None, 3)]  # 20 report samples in batches of 12, 3 steps
