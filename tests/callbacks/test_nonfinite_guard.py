"""Divergence is never silent: a fit whose loss or gradients turn non-finite
stops at that step with one line and exit status 3, every checkpoint left on disk is finite,
and the evaluation callbacks log NaN (with a warning) on non-finite features instead of
crashing."""
from __future__ import annotations

from helpers import folders

import json
import math
import os
import re
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from commands import lightning_cli as cli
from lightning_mods import exit_statuses
from callbacks.measurement.effective_rank import EffectiveRank
from callbacks.measurement.knn import KNNEvaluator
from callbacks.reliability.nonfinite_guard import NonFiniteGuard, NonFiniteTrainingError, total_norm
from datamodules.digits import Digits
from test_cli import DIGITS, TINY_MAE
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT


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
    assert stop.value.code == exit_statuses.DIVERGED
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shortcutlab:")]
    assert len(lines) == 1, lines
    # step 0's update at lr 1e8 makes step 1's gradients so large that their squares overflow
    assert "non-finite gradient norm (inf) at step 1 " in lines[0]
    checkpoints = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert {p.name for p in checkpoints} == {"epoch=0-step=1.ckpt", "last.ckpt"}
    assert all(all_finite(p) for p in checkpoints)  # the good ones, untouched
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 1


class InjectNaN(L.Callback):
    """Poison one weight before step ``step``'s forward (the data or a bad kernel would), on
    every rank or only on ``rank``; ``parameter`` picks which weight (default the first)."""

    def __init__(self, step: int, rank: int | None = None, parameter: str | None = None) -> None:
        self.step, self.rank, self.parameter = step, rank, parameter

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            weight = (dict(pl_module.named_parameters())[self.parameter] if self.parameter
                      else next(pl_module.parameters()))
            with torch.no_grad():
                weight.view(-1)[0] = float("nan")


def tiny_mae():
    from lightning_mods.mae import MaskedAutoencoder
    return MaskedAutoencoder(MaskedAutoencoderViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2), num_reconstructions=0, base_lr=1e-3, warmup_epochs=0)


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor-to-Python conversions (each a host sync on a GPU) made inside it."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
             torch.Tensor.__int__, torch.Tensor.__index__}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


class CountedGuard(NonFiniteGuard):
    """The guard, counting its reads and the host reads its per-step hooks make."""

    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        self.read_steps, self.step_hook_host_reads = [], 0

    def on_before_backward(self, trainer, pl_module, loss) -> None:  # noqa: ANN001
        with HostReads() as reads:
            super().on_before_backward(trainer, pl_module, loss)
        self.step_hook_host_reads += reads.count

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        with HostReads() as reads:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.step_hook_host_reads += reads.count

    def check(self, trainer, pl_module, weights: bool = False) -> None:  # noqa: ANN001
        self.read_steps.append(int(trainer.global_step))
        super().check(trainer, pl_module, weights)


def guarded_trainer(tmp_path, callbacks: list, max_steps: int, clip=None, **kwargs) -> L.Trainer:  # noqa: ANN001
    return L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, limit_val_batches=0, gradient_clip_val=clip,
                     callbacks=callbacks, default_root_dir=tmp_path, **kwargs)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_guard_reads_every_n_steps_and_names_the_step_that_went_non_finite(clip, tmp_path):
    guard = CountedGuard(check_every_n_steps=4)
    trainer = guarded_trainer(tmp_path, [guard, InjectNaN(5)], 20, clip, enable_checkpointing=False)
    with pytest.raises(NonFiniteTrainingError,
                       match=r"^non-finite training loss \(nan\) at step 5 \(epoch 0, batch 5\); training stopped"):
        trainer.fit(tiny_mae(), Digits(batch_size=64, image_size=8))
    assert guard.read_steps == [4, 8]  # the read after step 7 found step 5; none in between
    assert trainer.global_step == 8
    assert guard.step_hook_host_reads == 0  # the per-step checks never read a value back


def test_a_clean_run_reads_at_the_cadence_and_at_the_end(tmp_path):
    guard = CountedGuard()  # the trainer's log_every_n_steps
    trainer = guarded_trainer(tmp_path, [guard], 7, enable_checkpointing=False, log_every_n_steps=3)
    trainer.fit(tiny_mae(), Digits(batch_size=64, image_size=8))
    assert guard.read_steps == [3, 6, 7] and guard.step_hook_host_reads == 0


def test_values_noted_past_the_fold_limit_keep_the_first_bad_step(tmp_path, monkeypatch):
    """Under a cadence longer than the guard keeps values for, they are folded into the record
    on the device without a read: the read at the end still names step 3, not a later one."""
    import callbacks.reliability.nonfinite_guard as guard_module
    monkeypatch.setattr(guard_module, "FOLD_AFTER", 2)
    guard = CountedGuard(check_every_n_steps=1000)
    trainer = guarded_trainer(tmp_path, [guard, InjectNaN(3)], 9, enable_checkpointing=False)
    with pytest.raises(NonFiniteTrainingError, match=r"^non-finite training loss \(nan\) at step 3 \(epoch 0, batch 3\)"):
        trainer.fit(tiny_mae(), Digits(batch_size=64, image_size=8))
    assert guard.read_steps == [9] and guard.step_hook_host_reads == 0
    assert all(len(noted) <= 2 for noted in guard._noted)


def test_no_checkpoint_of_a_diverged_run_between_reads(tmp_path, capsys):
    """NaN at step 4, checkpoints every 3 steps, reads every 100: the save at step 6 reads the
    record first and the fit stops there; the step-3 checkpoint is the last, and finite."""
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1,
                                                save_last=True)
    trainer = guarded_trainer(tmp_path, [NonFiniteGuard(check_every_n_steps=100), InjectNaN(4), saver], 20)
    with pytest.raises(NonFiniteTrainingError, match=r"non-finite training loss \(nan\) at step 4 "):
        trainer.fit(tiny_mae(), Digits(batch_size=64, image_size=8))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert all(all_finite(p) for p in (tmp_path / "ckpt").iterdir())
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 3


def test_a_weight_the_loss_never_reads_is_caught_before_the_checkpoint(tmp_path):
    """Loss and gradients stay finite (the weight is unused): the check of every weight that
    precedes each save finds it, names the weight and writes nothing."""
    module = tiny_mae()
    module.unused = torch.nn.Parameter(torch.zeros(3))
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = guarded_trainer(tmp_path, [NonFiniteGuard(), InjectNaN(2, parameter="unused"), saver], 20)
    with pytest.raises(NonFiniteTrainingError, match=r"non-finite weight \(nan\) at the read at step 3 "):
        trainer.fit(module, Digits(batch_size=64, image_size=8))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]


def test_guard_settings_are_checked():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="check_every_n_steps"):
            NonFiniteGuard(check_every_n_steps=bad)


class NaNFeatures(L.LightningModule):
    """Evaluation features that are all NaN (a diverged backbone)."""

    num_features = 4

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        return torch.full((images.shape[0], 4), float("nan"))

    def forward_intermediates(self, images: torch.Tensor, indices=None, intermediates_only: bool = False):  # noqa: ANN001
        blocks = [self.forward_features(images)] * 2
        return blocks if intermediates_only else (self.forward_features(images), blocks)

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


DDP_SCRIPT = """
import json, os, sys, warnings
sys.path[:0] = {tests!r}
warnings.filterwarnings("ignore")
from commands import lightning_cli as cli
from test_cli import DIGITS, TINY_MAE
out = {out!r}
rank = os.environ["RANK"]
args = ["fit", *TINY_MAE, *DIGITS, "--trainer.max_steps=12", "--trainer.limit_val_batches=0",
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp",
        "--trainer.enable_progress_bar=false", "--trainer.logger=false", "--trainer.default_root_dir=" + out,
        "--trainer.callbacks+=test_nonfinite_guard.InjectNaN", "--trainer.callbacks.step=4", "--trainer.callbacks.rank=1",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=3", "--trainer.callbacks.save_top_k=-1",
        "--trainer.callbacks.save_last=true"]
try:
    cli.run_reporting_stops(args)
    code = 0
except SystemExit as stop:
    code = stop.code
with open(os.path.join(out, "rank" + rank + ".json"), "w") as f:
    json.dump({{"code": code}}, f)
sys.exit(code)
"""


@pytest.mark.slow
def test_two_process_ddp_stops_every_rank_at_the_step_one_rank_diverged(tmp_path, warm_shortcutlab):
    """Rank 1's weights go NaN before step 4: both ranks stop at the step-6 checkpoint's read
    with status 3 and a line naming step 4; only the finite step-3 checkpoint is on disk."""
    import subprocess
    import sys

    from helpers.fork_server import torchrun_workers
    from test_callbacks_ddp import REPO, TESTS, free_port

    script = tmp_path / "diverge.py"
    script.write_text(DDP_SCRIPT.format(tests=folders.PATHS, out=str(tmp_path)))
    env = dict(os.environ, PYTHONPATH=folders.PYTHONPATH, OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script)]
    proc = subprocess.run(torchrun_workers(cmd, warm_shortcutlab), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
                          start_new_session=True)
    codes = [json.loads((tmp_path / f"rank{r}.json").read_text())["code"] for r in range(2)]
    assert codes == [exit_statuses.DIVERGED] * 2, proc.stderr[-4000:]
    # the ranks share one stderr pipe: their lines may run together, so they are found, not split
    lines = re.findall(r"shortcutlab: error: non-finite [^;]*;", proc.stderr)
    assert len(lines) == 2, proc.stderr[-4000:]
    assert all("at step 4 (epoch 0, batch 4)" in line for line in lines), lines
    assert sorted("(nan)" in line for line in lines) == [False, True]  # rank 0 names the other rank
    checkpoints = sorted((tmp_path / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in checkpoints] == ["epoch=0-step=3.ckpt", "last.ckpt"]
    assert all(all_finite(p) for p in checkpoints)


def test_total_norm_is_the_2_norm_over_every_gradient():
    """float64 numpy as the reference; mixed dtypes promote; a NaN, an inf, or squares whose sum
    overflows float32 while every gradient is finite, all give a non-finite norm."""
    grads = [torch.tensor([3.0, -4.0]), torch.tensor([[1.5]], dtype=torch.bfloat16), torch.tensor([2.0, 0.5])]
    expected = np.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert float(total_norm(grads)) == pytest.approx(expected, rel=1e-6)
    assert float(total_norm(grads[:1])) == 5.0
    for bad in (float("nan"), float("inf")):
        assert not torch.isfinite(total_norm([grads[0], torch.tensor([1.0, bad])]))
    huge = torch.full((4,), 3e38)  # finite, the sum of squares is not
    assert torch.isfinite(huge).all() and not torch.isfinite(total_norm([huge]))
