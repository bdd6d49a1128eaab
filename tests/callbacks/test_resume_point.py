"""The resume point: one latest.ckpt rewritten at every epoch's end; the checkpoint cadence knob
leaves it (by its class, not its file name), and a run whose config wrote it as a plain
ModelCheckpoint resumes into it."""
from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from callbacks.reliability.resume_point import EpochResumePoint
from commands.cli_settings import apply_cadences


def test_latest_every_epoch_and_a_plain_checkpoints_state_key():
    point = EpochResumePoint()
    assert (point.filename, point._every_n_epochs, point.save_top_k, point._save_on_train_epoch_end) == \
        ("latest", 1, 1, True)
    plain = ModelCheckpoint(filename="latest", every_n_epochs=1, save_top_k=1, save_on_train_epoch_end=True)
    assert point.state_key == plain.state_key
    assert EpochResumePoint(save_last="link").save_last == "link"


def test_the_checkpoint_knob_sets_every_checkpoint_but_the_resume_point():
    from jsonargparse import Namespace

    entries = [Namespace(class_path="callbacks.reliability.resume_point.EpochResumePoint", init_args=Namespace()),
               Namespace(class_path="lightning.pytorch.callbacks.ModelCheckpoint",
                         init_args=Namespace(filename="latest", every_n_epochs=1))]
    apply_cadences(entries, None, 7)
    assert "every_n_epochs" not in entries[0].init_args  # the resume point keeps its every epoch
    assert entries[1].init_args.every_n_epochs == 7  # a plain checkpoint named latest is no exception


def test_it_rewrites_latest_ckpt_at_each_epoch(tmp_path):
    import torch
    from helpers.line_module import Line

    trainer = Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[EpochResumePoint(dirpath=tmp_path)])
    points = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 2)), batch_size=4)
    trainer.fit(Line(), train_dataloaders=points)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.ckpt"]
    assert torch.load(tmp_path / "latest.ckpt", weights_only=True)["epoch"] == 1
