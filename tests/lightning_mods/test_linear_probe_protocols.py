"""MAE's ImageNet-1K linear-probe protocol (configs/probe/mae_imagenet1k.yaml) on the digits
(docs/reproducing.md, "In small, on the digits"),
from an MAE checkpoint: it trains with LARS at the scaled rate, reads the cls token, reports
top-1, and a run resumed from its mid-run checkpoint ends with the uninterrupted run's head."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from timm.optim import Lars

from helpers import folders
from commands import lightning_cli as cli

MAE_CKPT = folders.TESTS / "data" / "written_by_0_1_0" / "last.ckpt"


EVERY_3_STEPS = ('--trainer.callbacks+={"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": '
                 '{"filename": "every-{step}", "save_top_k": -1, "every_n_train_steps": 3}}')


def probe(root: Path, epochs: int, ckpt_path: Path | None = None):  # noqa: ANN201
    args = ["fit", f"--config={folders.REPO / 'configs' / 'linear_probe_digits.yaml'}",
            f"--config={folders.REPO / 'configs' / 'probe' / 'mae_imagenet1k.yaml'}", EVERY_3_STEPS,
            f"--model.checkpoint={MAE_CKPT}", "--data.batch_size=64", "--model.warmup_epochs=1",
            f"--trainer.max_epochs={epochs}", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=2",
            "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
            f"--trainer.default_root_dir={root}"]
    return cli.main(args + ([f"--ckpt_path={ckpt_path}"] if ckpt_path else []))


@pytest.mark.slow
def test_the_mae_protocol_probe_trains_reports_and_resumes_exactly(tmp_path):
    straight = probe(tmp_path / "straight", 3)
    optimizer = straight.trainer.optimizers[0]
    assert isinstance(optimizer, Lars)
    assert [g["always_adapt"] for g in optimizer.param_groups] == [True, False]  # weights / bias
    assert optimizer.param_groups[0]["weight_decay"] == 0.0
    scheduler = straight.trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.base_lrs[0] == pytest.approx(0.1 * 64 / 256)  # 0.1 per 256 of the global batch
    assert straight.model.backbone.feature_pool == "cls"
    assert 0.0 <= float(straight.trainer.callback_metrics["val/top1"]) <= 1.0

    # the same run, resumed from its checkpoint at step 6 (its epochs are 3 steps)
    second = next((tmp_path / "straight").rglob("every-step=6.ckpt"))
    resumed = probe(tmp_path / "resumed", 3, second)
    for name, value in straight.model.head.state_dict().items():
        assert torch.equal(value, resumed.model.head.state_dict()[name]), name
    assert float(resumed.trainer.callback_metrics["val/top1"]) == float(straight.trainer.callback_metrics["val/top1"])
