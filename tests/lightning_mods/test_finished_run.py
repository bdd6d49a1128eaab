"""A pre-training named by its folder (lightning_mods/checkpointing/_finished_run.py): fine-tuning and
the probes start from the final checkpoint of its finished fit, whatever version wrote it (a
resumed run logs on in its checkpoint's version, a second run in the same folder to a new one),
and a pre-training that did not finish is a one-line error naming its checkpoint."""
from __future__ import annotations

import pytest
import torch
import yaml

from commands import lightning_cli as cli
from lightning_mods.checkpointing._finished_run import final_checkpoint
from lightning_mods.finetune import FineTuneClassifier
from lightning_mods.linear_probe import LinearProbe

TINY = ["--config=configs/digits_mae.yaml", "--model.network.depth=2", "--model.network.decoder_depth=1", "--model.network.embed_dim=32",
        "--model.network.num_heads=2", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu", "--trainer.check_val_every_n_epoch=1"]


@pytest.fixture(scope="module")
def resumed_pretraining(tmp_path_factory):
    """A pre-training of 1 epoch, resumed to 2 (--ckpt_path auto, logging on in version_0); the
    1-epoch checkpoint is kept aside as ``one_epoch.ckpt``."""
    import shutil

    root = tmp_path_factory.mktemp("pretraining")
    cli.run_reporting_stops(["fit", *TINY, "--trainer.max_epochs=1", f"--trainer.default_root_dir={root}"])
    shutil.copy(root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt", root.parent / "one_epoch.ckpt")
    cli.run_reporting_stops(["fit", *TINY, "--trainer.max_epochs=2", f"--trainer.default_root_dir={root}",
                             "--ckpt_path=auto"])
    return root


def weights(path) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return torch.load(path, weights_only=True)["state_dict"]


def test_the_folder_names_the_resumed_run_s_final_checkpoint(resumed_pretraining):
    first = resumed_pretraining.parent / "one_epoch.ckpt"
    final = resumed_pretraining / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in (resumed_pretraining / "lightning_logs").iterdir()) == ["version_0"]
    assert first.is_file() and final.is_file()
    assert torch.load(final, weights_only=True)["global_step"] == 4  # two epochs of 2 steps
    assert final_checkpoint(resumed_pretraining) == final  # the resumed run's, not the 1-epoch network
    probe = LinearProbe(checkpoint=str(resumed_pretraining), num_classes=10)
    assert probe.hparams.checkpoint == str(final)  # recorded as the file: a resumed probe reads the same
    written = weights(final)
    for name, value in probe.backbone.state_dict().items():  # the MAE's network: its weights network.*
        assert torch.equal(value, written[f"network.{name}"]), name
    assert any(not torch.equal(written[k], v) for k, v in weights(first).items() if k in written)


def test_a_pre_training_that_did_not_finish_is_one_line_naming_its_checkpoint(resumed_pretraining, tmp_path):
    import shutil

    interrupted = tmp_path / "interrupted"
    shutil.copytree(resumed_pretraining, interrupted)
    config_file = interrupted / "lightning_logs" / "version_0" / "config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["trainer"]["max_epochs"] = 3  # as a run stopped after 2 of its 3 epochs has it on disk
    config_file.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=r"version_0/checkpoints/\S+\.ckpt', was written after 2 epochs \(4 steps\) "
                                         r"of the 3 epochs its config asks for: its pre-training did not finish") as err:
        final_checkpoint(interrupted)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="no checkpoint that loads under"):
        final_checkpoint(tmp_path / "empty")


def test_a_probe_pointed_at_a_probe_says_it_holds_a_probe(resumed_pretraining, tmp_path):
    """A probe run's folder (or its checkpoint) given where a pre-training belongs: one line saying
    it holds a linear probe and which checkpoint that probe read, before anything is built."""
    probe_run = tmp_path / "probe_run"
    cli.run_reporting_stops(["fit", "--config=configs/linear_probe_digits.yaml",
                             f"--model.checkpoint={resumed_pretraining}", "--trainer.max_epochs=1",
                             "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=1",
                             "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={probe_run}"])
    written = final_checkpoint(probe_run)
    read = resumed_pretraining / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    for given, where in ((probe_run, f"'{probe_run}' is the folder of"), (written, f"'{written}' holds")):
        for recipe in (LinearProbe, FineTuneClassifier):
            with pytest.raises(ValueError) as refused:
                recipe(checkpoint=str(given), num_classes=10)
            assert str(refused.value) == (
                f"model.checkpoint: {where} a linear probe (LinearProbe, '{written}'), not a pre-training; give the "
                f"pre-training's folder or checkpoint (this probe read '{read}')"), recipe
