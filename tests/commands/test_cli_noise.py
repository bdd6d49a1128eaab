"""Third-party noise a fit printed (commands/lightning_cli.py: silence_third_party_noise,
expect_frozen_eval_modules) is filtered precisely: Lightning's eval-mode warning still shows for
a module left in eval mode by mistake."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from commands.cli_output import expect_frozen_eval_modules, frozen_eval_mode_count, silence_third_party_noise

REPO = Path(__file__).resolve().parents[2]
NOISE = ("💡 Tip", "Trainer already configured with model summary callbacks", "to estimate number of stepping batches",
         "LeafSpec", "module(s) in eval mode")


class FrozenBackboneProbe(LightningModule):
    """A frozen backbone in eval mode (Linear, ReLU, Linear: 4 modules with its container) and a
    trainable head; ``stray_eval`` leaves a parameter-free Dropout of the head in eval mode."""

    def __init__(self, stray_eval: bool = False) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4))
        self.backbone.requires_grad_(False)
        self.backbone.eval()
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(4, 2))
        if stray_eval:
            self.head[0].eval()

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.head(self.backbone(batch[0])), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def eval_mode_warnings(model: LightningModule, tmp_path, expect: bool) -> list[str]:
    loader = DataLoader(TensorDataset(torch.randn(4, 3), torch.tensor([0, 1, 0, 1])), batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if expect:
            expect_frozen_eval_modules(model)
        Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                enable_checkpointing=False, default_root_dir=tmp_path).fit(model, loader)
    return [str(w.message) for w in caught if "in eval mode at the start of training" in str(w.message)]


def test_eval_mode_warning_silenced_only_for_the_frozen_modules(tmp_path):
    assert frozen_eval_mode_count(FrozenBackboneProbe()) == 4
    assert frozen_eval_mode_count(FrozenBackboneProbe(stray_eval=True)) is None
    assert frozen_eval_mode_count(nn.Sequential(nn.Linear(2, 2))) is None  # nothing in eval mode
    # Lightning warns about the 4 frozen modules unless told they are intentional ...
    assert eval_mode_warnings(FrozenBackboneProbe(), tmp_path, expect=False)[0].startswith("Found 4 module(s)")
    assert eval_mode_warnings(FrozenBackboneProbe(), tmp_path, expect=True) == []
    # ... and a module left in eval mode by mistake still shows (5 modules)
    stray = eval_mode_warnings(FrozenBackboneProbe(stray_eval=True), tmp_path, expect=True)
    assert stray and stray[0].startswith("Found 5 module(s)")


def test_lightning_tips_are_dropped_and_other_info_kept(caplog):
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    silence_third_party_noise()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](x)")
        rank_zero_info("Trainer already configured with model summary callbacks: [RichModelSummary].")
        rank_zero_info("GPU available: False, used: False")
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]


@pytest.mark.slow
def test_a_short_probe_fit_prints_no_third_party_noise(tmp_path):
    backbone = ("{class_path: lightning_mods.backbone.masked_autoencoder.MaskedAutoencoderViT, init_args: {"
                "img_size: 16, in_chans: 1, patch_size: 8, embed_dim: 16, depth: 2, num_heads: 2, "
                "decoder_embed_dim: 16, decoder_depth: 1, decoder_num_heads: 2}}")
    command = [sys.executable, "-c", "import cli; cli.console_main()", "fit",
               "--config", "configs/linear_probe_digits.yaml", f"--model.backbone={backbone}",
               "--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
               "--trainer.log_every_n_steps=1", "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for text in NOISE:
        assert text not in done.stderr and text not in done.stdout, text
    assert "Seed set to 0" in done.stdout and "Modules in eval mode" in done.stdout  # the run's own facts stay


def test_the_repeated_samples_warning_is_answered_only_for_models_that_leave_repeats_out():
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    from commands.cli_output import answer_repeated_samples_warning
    from lightning_mods.backbone.residual_mlp import ResidualMLP
    from lightning_mods.spiral_classifier import SpiralClassifier

    message = ("Using `DistributedSampler` with the dataloaders. During `trainer.validate()`, it is recommended to "
               "use `Trainer(devices=1, num_nodes=1)` to ensure each sample/batch gets evaluated exactly once.")
    for model, shown in ((torch.nn.Linear(2, 2), 1), (SpiralClassifier(ResidualMLP(depth=2, width=4)), 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            answer_repeated_samples_warning(model)
            warnings.warn(message, PossibleUserWarning)
        assert len(caught) == shown, model


TINY_MAE = ["--config=configs/digits_mae.yaml", "--model.network.embed_dim=16", "--model.network.depth=2",
            "--model.network.num_heads=2", "--model.network.decoder_embed_dim=16", "--model.network.decoder_depth=1",
            "--model.network.decoder_num_heads=2", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
            "--trainer.check_val_every_n_epoch=1", "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu",
            "--trainer.log_every_n_steps=1"]


def folder_warnings(args: list[str]) -> list[str]:
    """Lightning's "exists and is not empty" warnings of a fit of ``args``, in this process."""
    from commands import lightning_cli

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lightning_cli.run_reporting_stops(["fit", *TINY_MAE, *args])
    return [str(w.message) for w in caught if "exists and is not empty" in str(w.message)]


@pytest.mark.slow
def test_a_sweeps_run_and_a_resume_get_no_warning_about_their_own_folders(tmp_path, monkeypatch):
    """A sweep's run folder holds its run.yaml and log before the fit starts; a resumed fit finds
    its checkpoints and metrics there. Neither is lost (the metrics logged before the checkpoint
    are put back), so Lightning's "exists and is not empty ... will be deleted" warnings are not
    printed; a new fit into a used folder still gets both."""
    from commands._run_folder import write_logging_fragment
    from commands._run_loggers import run_loggers

    monkeypatch.chdir(REPO)
    save_dir, name = tmp_path / "experiment", "seed=0"
    fragment = write_logging_fragment(save_dir, name, run_loggers(None, save_dir, name, "experiment"))
    (save_dir / name / "sweep.log").write_text("$ shortcutlab fit ...\n")
    run = [f"--config={fragment}"]
    assert folder_warnings([*run, "--trainer.max_epochs=1"]) == []
    first_epoch = (save_dir / name / "metrics.csv").read_text().splitlines()
    assert folder_warnings([*run, "--trainer.max_epochs=2",
                            f"--ckpt_path={save_dir / name / 'checkpoints' / 'last.ckpt'}"]) == []
    resumed = (save_dir / name / "metrics.csv").read_text().splitlines()
    assert resumed[0] == first_epoch[0] and resumed[1:len(first_epoch)] == first_epoch[1:]  # epoch 0 kept
    assert len(resumed) > len(first_epoch) and resumed[-1].startswith("1,")

    plain = [f"--trainer.default_root_dir={tmp_path / 'plain'}"]  # the documented --ckpt_path auto
    assert folder_warnings([*plain, "--trainer.max_epochs=1"]) == []
    assert folder_warnings([*plain, "--trainer.max_epochs=2", "--ckpt_path=auto"]) == []
    rerun = folder_warnings([*run, "--trainer.max_epochs=1"])  # a new fit into a used folder: both are true
    assert len(rerun) == 2 and "Previous log files in this directory will be deleted" in rerun[0]
    assert rerun[1] == f"Checkpoint directory {save_dir / name / 'checkpoints'} exists and is not empty."
