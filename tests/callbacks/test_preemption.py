"""Pre-emption: a real SIGTERM / SIGINT sent to a ``shortcutlab fit``
subprocess (a warm fork of the CLI, tests/helpers/fork_server.py) writes a resumable ``last.ckpt`` and exits with 143 / 130; resuming from it reaches
the uninterrupted fit's weights and optimiser state bit for bit."""
from __future__ import annotations

from helpers import folders

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from commands import lightning_cli as cli
from helpers.composed_configs import ROWS, SINGLE_FILES, declared_callbacks
from test_cli import DIGITS, TINY_MAE
from test_exact_resume import assert_identical

ROOT = Path(__file__).resolve().parents[2]
STOP_STEP = 3


def fit_args(root: Path) -> list[str]:
    return ["fit", *TINY_MAE, *DIGITS, "--seed_everything=0", "--trainer.max_epochs=3",
            "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1", "--trainer.accelerator=cpu",
            "--trainer.devices=1", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
            f"--trainer.default_root_dir={root}"]


def interrupted_fit(shortcutlab: list[str], root: Path, signum: int) -> tuple[subprocess.CompletedProcess, Path]:
    ready = root / "ready"
    env = {**os.environ, "PYTHONPATH": folders.PYTHONPATH}
    command = [*shortcutlab, *fit_args(root),
               "--trainer.callbacks+=helpers.signal_helpers.WaitForSignal", f"--trainer.callbacks.step={STOP_STEP}",
               f"--trainer.callbacks.ready_file={ready}"]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert proc.poll() is None, f"fit ended before step {STOP_STEP}: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "fit did not reach the step in time"
        time.sleep(0.05)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(command, proc.returncode, "", stderr), root / "checkpoints" / "last.ckpt"


def final_state(out: cli.ShortcutLabCLI) -> dict:
    return {"weights": out.model.state_dict(), "optimizer": out.trainer.optimizers[0].state_dict(),
            "step": out.trainer.global_step}


@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_writes_a_resumable_checkpoint_and_exits_128_plus_signal(signum, status, tmp_path, warm_shortcutlab):
    result, checkpoint = interrupted_fit(warm_shortcutlab, tmp_path / "interrupted", signum)
    assert result.returncode == status, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("shortcutlab:")]
    assert len(lines) == 1 and f"stopped by {signal.Signals(signum).name} at step {STOP_STEP};" in lines[0], lines
    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == STOP_STEP
    if signum != signal.SIGTERM:
        return  # the resume is the same for both signals: checked once
    resumed = final_state(cli.main(fit_args(tmp_path / "resumed") + [f"--ckpt_path={checkpoint}"]))
    full = final_state(cli.main(fit_args(tmp_path / "full")))
    assert full["step"] == resumed["step"] == 9
    assert_identical(resumed, full)


@pytest.mark.parametrize("name", list(ROWS) + SINGLE_FILES)
def test_every_config_ends_its_fit_with_a_run_summary(name):
    """Every composition of configs/compositions.yaml and every single-file config prints its final
    numbers and checkpoints at the end of a fit."""
    assert "callbacks.reporting.run_summary.RunSummary" in {c["class_path"] for c in declared_callbacks(name)}


RELIABILITY = {"callbacks.reliability.exact_resume.ExactResume", "callbacks.reliability.nonfinite_guard.NonFiniteGuard",
               "callbacks.reliability.preemption.PreemptionCheckpoint"}


@pytest.mark.parametrize("name", list(ROWS) + SINGLE_FILES)
def test_every_config_checkpoints_every_epoch_whatever_its_evaluation_cadence(name):
    """Every composition of configs/compositions.yaml and every single-file config."""
    callbacks = declared_callbacks(name)
    names = {c["class_path"] for c in callbacks}
    assert RELIABILITY <= names, sorted(RELIABILITY - names)
    # the resume point saves at the end of every training epoch (not only after validations), as it is
    every_epoch = [c.get("init_args", {}) for c in callbacks
                   if c["class_path"] == "callbacks.reliability.resume_point.EpochResumePoint"
                   and not {"every_n_epochs", "save_on_train_epoch_end", "save_top_k"} & set(c.get("init_args") or {})]
    assert every_epoch, "no EpochResumePoint saving at every training epoch's end"


def test_a_signal_during_validation_saves_the_training_weights_not_the_ema_ones_swapped_in(tmp_path, capsys):
    """EMAWeightAveraging swaps the averaged weights into the module for validation. A SIGTERM
    there lets the validation finish and the checkpoint holds the training weights as
    ``current_model_state`` and the averaged ones as ``state_dict``, as every other checkpoint
    of the run holds them."""
    import lightning as L
    from lightning.pytorch.callbacks import EMAWeightAveraging
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    from torch.utils.data import DataLoader, TensorDataset

    from callbacks.reliability.preemption import PreemptionCheckpoint
    from helpers.line_module import Line

    seen: dict[str, torch.Tensor] = {}

    class StoppedInValidation(Line):
        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            seen["training"] = self.lin.weight.detach().clone()  # after the last step: what validation swaps out

        def validation_step(self, batch, batch_idx):
            seen["validated"] = batch_idx + 1
            if batch_idx == 0:
                seen["averaged"] = self.lin.weight.detach().clone()
                os.kill(os.getpid(), signal.SIGTERM)

    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
                        callbacks=[PreemptionCheckpoint(), EMAWeightAveraging(decay=0.5)])
    with pytest.raises(SIGTERMException):
        trainer.fit(StoppedInValidation(lr=0.5), loader, loader)
    assert not torch.equal(seen["training"], seen["averaged"])  # the averaged weights were swapped in
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert torch.equal(saved["current_model_state"]["lin.weight"], seen["training"])
    assert torch.equal(saved["state_dict"]["lin.weight"], seen["averaged"])
    assert seen["validated"] == 4  # every validation batch ran
    assert "shortcutlab: SIGTERM during validation: stopping when it ends" in capsys.readouterr().err


def test_a_signal_during_validate_writes_no_checkpoint(tmp_path, capsys):
    """Outside fit there is nothing to resume: no last.ckpt (one without optimiser state would
    replace the fit's in a shared folder), one line saying so."""
    import lightning as L
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    from torch.utils.data import DataLoader, TensorDataset

    from callbacks.reliability.preemption import PreemptionCheckpoint
    from helpers.line_module import Line

    class StoppedInValidation(Line):
        def validation_step(self, batch, batch_idx):
            if batch_idx == 0:
                os.kill(os.getpid(), signal.SIGTERM)

    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[PreemptionCheckpoint()])
    with pytest.raises(SIGTERMException):
        trainer.validate(StoppedInValidation(), loader)
    assert not (tmp_path / "checkpoints").exists()
    assert "stopped by SIGTERM during validate; no checkpoint written" in capsys.readouterr().err


def test_under_ddp_the_ranks_decide_every_n_steps_not_every_step(monkeypatch):
    """Issue 18, item 1: the stop decision's collective runs at the cadence's steps (and at
    epoch ends), not after every batch."""
    from types import SimpleNamespace

    from callbacks.reliability import preemption

    decided = []
    callback = preemption.PreemptionCheckpoint(check_every_n_steps=3)
    monkeypatch.setattr(preemption, "_distributed", lambda trainer: True)
    monkeypatch.setattr(callback, "_decide", lambda trainer: decided.append(trainer.global_step))
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=50)
    for step in range(1, 11):
        trainer.global_step = step
        callback.on_train_batch_end(trainer, None, None, None, step - 1)
        callback.on_train_batch_end(trainer, None, None, None, step - 1)  # a second micro-batch: same step
    callback.on_train_epoch_end(trainer, None)
    assert decided == [3, 6, 9, 10]
    default = preemption.PreemptionCheckpoint()
    monkeypatch.setattr(default, "_decide", lambda trainer: decided.append(("default", trainer.global_step)))
    for step in (49, 50, 51, 100):
        trainer.global_step = step
        default.on_train_batch_end(trainer, None, None, None, 0)
    assert decided[4:] == [("default", 50), ("default", 100)]
    with pytest.raises(ValueError, match="check_every_n_steps"):
        preemption.PreemptionCheckpoint(check_every_n_steps=0)
