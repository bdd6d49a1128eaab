"""Divergence is never silent (issue 9, item 4): a fit whose loss or gradients turn non-finite
stops at that step with one line and exit status 3, every checkpoint left on disk is finite,
and the evaluation callbacks log NaN (with a warning) on non-finite features instead of
crashing."""
from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch

from commands import lightning_cli as cli
from callbacks.effective_rank import EffectiveRank
from callbacks.knn import KNNEvaluator
from callbacks.nonfinite_guard import NonFiniteGuard, NonFiniteTrainingError
from datamodules.digits import Digits
from test_cli import DIGITS, TINY_MAE


def all_finite(path: Path) -> bool:
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def test_diverging_fit_stops_at_the_step_with_one_line_and_status_3(tmp_path, capsys):
    args = ["fit", *TINY_MAE, *DIGITS, "--model.init_args.base_lr=1e8", "--model.init_args.warmup_epochs=0",
            "--trainer.max_epochs=2", "--trainer.limit_train_batches=10", "--trainer.limit_val_batches=0",
            "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1",
            "--trainer.callbacks.save_last=true"]
    with pytest.raises(SystemExit) as stop:
        cli.run_reporting_stops(args)
    assert stop.value.code == cli.DIVERGED_EXIT_STATUS
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shortcutlab:")]
    assert len(lines) == 1, lines
    assert "non-finite" in lines[0] and "(nan)" in lines[0] and "at step 2 " in lines[0]
    checkpoints = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert {p.name for p in checkpoints} == {"epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"}
    assert all(all_finite(p) for p in checkpoints)  # the good ones, untouched
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 2


class InjectNaN(L.Callback):
    """Poison one weight before step ``step``'s forward (the data or a bad kernel would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("nan")


def tiny_mae():
    from lightning_mods.mae import MaskedAutoencoder
    return MaskedAutoencoder(image_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                             decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, num_reconstructions=0,
                             base_lr=1e-3, warmup_epochs=0)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_guard_raises_before_the_optimizer_step(clip, tmp_path):
    module = tiny_mae()
    trainer = L.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        gradient_clip_val=clip, callbacks=[NonFiniteGuard(), InjectNaN(3)],
                        default_root_dir=tmp_path)
    with pytest.raises(NonFiniteTrainingError, match=r"non-finite training loss \(nan\) at step 3 "):
        trainer.fit(module, Digits(batch_size=64, image_size=8))
    assert trainer.global_step == 3  # step 3 never reached the optimizer
    poisoned = next(module.parameters()).detach().view(-1)
    assert math.isnan(poisoned[0]) and bool(torch.isfinite(poisoned[1:]).all())


class NaNFeatures(L.LightningModule):
    """Evaluation features that are all NaN (a diverged backbone)."""

    num_features = 4

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        return torch.full((images.shape[0], 4), float("nan"))

    def forward_block_features(self, images: torch.Tensor) -> list[torch.Tensor]:
        return [self.forward_features(images)] * 2

    def validation_step(self, batch, batch_idx):  # noqa: ANN001
        return None


def test_evaluation_callbacks_log_nan_on_non_finite_features(tmp_path):
    rank, knn = EffectiveRank(per_block=True, draw_profile=False), KNNEvaluator(k=5)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[rank, knn], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="non-finite"):
        trainer.validate(NaNFeatures(), Digits(batch_size=256, image_size=8))
    metrics = trainer.callback_metrics
    for name in ("rank/effective_rank", "rank/entropy", "knn/top1", "knn/top5"):
        assert math.isnan(float(metrics[name])), name
    assert rank.last_profile["effective_rank"] and all(math.isnan(r) for r in rank.last_profile["effective_rank"])
