"""Evaluation over depth (``lightning_mods.evaluation.over_depth``): the linear probe's per-block
heads equal to probes of that block alone with the same seed; bad block choices; the report's
best- and last-block columns. Each measurement callback's per-block figures are checked in its
own test file (tests/callbacks/test_knn.py, test_online_probe.py, test_effective_rank.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from commands import report
from datamodules.digits import Digits
from lightning_mods.linear_probe import LinearProbe
from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.evaluation.over_depth import DEPTH_FILE, check_blocks, resolve_blocks
from helpers.tiny_runs import rows_by_block
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT




def tiny_mae() -> MaskedAutoencoder:
    return MaskedAutoencoder(MaskedAutoencoderViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=4, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2), num_reconstructions=0)


def probe_fit(tmp_path: Path, blocks) -> LinearProbe:  # noqa: ANN001
    seed_everything(0)
    torch.manual_seed(0)
    backbone = tiny_mae()
    seed_everything(0)
    probe = LinearProbe(backbone=backbone, num_classes=10, blocks=blocks, lr=0.05)
    trainer = Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                      limit_train_batches=4, limit_val_batches=2, num_sanity_val_steps=1)
    trainer.fit(probe, Digits(batch_size=32, image_size=8))
    return probe


def test_linear_probe_over_all_blocks_equals_single_block_probes(tmp_path):
    together = probe_fit(tmp_path / "all", "all")
    table = rows_by_block(tmp_path / "all" / DEPTH_FILE, epoch=1)
    assert sorted(table) == [1, 2, 3, 4]
    for block in (2, 4):
        alone = probe_fit(tmp_path / f"b{block}", [block])
        row = rows_by_block(tmp_path / f"b{block}" / DEPTH_FILE, epoch=1)[block]
        assert row["val/top1"] == table[block]["val/top1"]
        for a, b in zip(together.block_heads[str(block)].state_dict().values(),
                        alone.block_heads[str(block)].state_dict().values()):
            assert torch.equal(a, b), block
    # the forward_features head is the probe without blocks, unchanged by the block heads
    plain = probe_fit(tmp_path / "plain", None)
    for a, b in zip(together.head.state_dict().values(), plain.head.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("blocks", [[], [0], [1, 1], "some", [1.5], True])
def test_bad_block_choices_are_one_line_errors(blocks):
    with pytest.raises(ValueError, match=r"^KNNEvaluator: blocks must be null \(the evaluation features only\), "
                                         r"'all' or a list of distinct block indices"):
        check_blocks("KNNEvaluator", blocks)


def test_blocks_that_do_not_exist_are_named():
    assert resolve_blocks("x", [-1, 1], 12) == [1, 12]
    with pytest.raises(ValueError, match=r"^KNNEvaluator: blocks \[13\] do not exist: the model has 12 blocks "
                                         r"\(1 to 12, or -1 to -12\)$"):
        resolve_blocks("KNNEvaluator", [13], 12)


def test_report_takes_the_best_and_the_last_block(tmp_path):
    """Hand-written tables: the best block's and the last block's top-1 of the last evaluation,
    mean and std over seeds against numpy float64."""
    knn = {0: [0.30, 0.62, 0.55], 1: [0.34, 0.58, 0.60]}  # blocks 1..3 at the last evaluation
    for seed, values in knn.items():
        run = tmp_path / "depth" / f"alpha_min=0.6,seed={seed}"
        run.mkdir(parents=True)
        run.joinpath("metrics.csv").write_text("epoch,knn/top1,step\n1,0.5,19\n")
        lines = ["epoch,step,block,feature/norm,knn/top1"]
        lines += [f"0,9,{b},1.0,0.99" for b in (1, 2, 3)]  # an earlier evaluation, not reported
        lines += [f"1,19,{b},1.0,{v}" for b, v in enumerate(values, start=1)]
        run.joinpath(DEPTH_FILE).write_text("\n".join(lines) + "\n")
        run.joinpath("sweep.json").write_text(json.dumps({"name": run.name, "status": 0}))
    markdown = report.make_report(tmp_path / "depth", tmp_path / "depth" / "report")["markdown"]
    header = [c.strip() for c in markdown.splitlines()[2].strip("|").split("|")]
    assert header == ["alpha_min", "n (seeds)", "kNN top-1 (%)", "kNN top-1 @best_block (%)",
                      "kNN top-1 @last_block (%)"]
    row = [c.strip() for c in markdown.splitlines()[4].strip("|").split("|")]
    best = np.array([max(v) for v in knn.values()], dtype=np.float64)
    last = np.array([v[-1] for v in knn.values()], dtype=np.float64)
    assert row[3] == f"{100 * best.mean():.1f} ± {100 * best.std(ddof=1):.1f}"
    assert row[4] == f"{100 * last.mean():.1f} ± {100 * last.std(ddof=1):.1f}"
    assert not math.isnan(best.mean())
