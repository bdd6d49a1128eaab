"""The kNN bank's storage, its memory check and the progress of its passes: the bank is kept
unit-length in the dtype asked for; a bank that would not fit stops the run in one line before
any feature pass (the memory model checked against hand-computed sizes); each pass over a
dataset shows a bar in the Trainer's Rich display and logs its duration."""
from __future__ import annotations

import io
import logging
import re

import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar

import callbacks.measurement.knn_bank as knn_bank
from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.knn_bank import BankTooLarge, bank_bytes, shard_rows
from callbacks.measurement.shared_features import SharedEvaluation
from commands import lightning_cli as cli
from helpers.tiny_runs import TinyData, TinyNet, tiny_trainer


class RecordedBank(KNNEvaluator):
    """A KNNEvaluator that keeps the bank tensors it scored."""

    def _score(self, bank, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        self.scored = getattr(self, "scored", []) + [bank]
        return super()._score(bank, *args, **kwargs)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_bank_is_kept_unit_length_in_the_dtype_asked_for(tmp_path, dtype):
    knn = RecordedBank(k=5, blocks="all", bank_dtype=dtype, bank_device="cpu")
    trainer = tiny_trainer(tmp_path, [SharedEvaluation(), knn], max_epochs=1, limit_train_batches=2,
                           num_sanity_val_steps=0)
    trainer.fit(TinyNet(), datamodule=TinyData())
    assert len(knn.scored) == 3  # the features and two blocks
    for bank in knn.scored:
        assert bank.dtype == getattr(torch, dtype) and bank.device.type == "cpu" and bank.shape[0] == 48
        torch.testing.assert_close(bank.float().norm(dim=1), torch.ones(48), atol=1e-2, rtol=0)


def test_the_memory_model_gives_the_documented_imagenet_sizes():
    """docs/multi-gpu.md: ViT-B/16 on ImageNet-1K, every block (13 banks of 768)."""
    widths, images, gib = [768] * 13, 1_281_167, 2 ** 30
    assert bank_bytes(images, widths, torch.float32) == images * (13 * 768 * 4 + 8)
    assert round(bank_bytes(images, widths, torch.float32) / gib, 1) == 47.7
    assert round(bank_bytes(images, widths, torch.float16) / gib, 1) == 23.8
    # the ranks own whole batches of 256: rank 0 holds 626 of the 5005
    assert shard_rows(images, 8, 256) == 160_256 and round(bank_bytes(160_256, widths, torch.float16) / gib, 2) == 2.98
    assert round(bank_bytes(shard_rows(images, 8, 256), widths, torch.float32) / gib, 2) == 5.96
    assert round(bank_bytes(shard_rows(images, 64, 256), widths, torch.float16) / gib, 2) == 0.38
    assert round(bank_bytes(shard_rows(images, 64, 256), widths, torch.float32) / gib, 2) == 0.75
    assert round(50_000 * 13 * 768 * 4 / gib, 2) == 1.86


class CountedNet(TinyNet):
    def __init__(self) -> None:
        super().__init__()
        self.images_seen = 0

    def forward_intermediates(self, x, indices=None, intermediates_only=False):  # noqa: ANN001, ANN201
        self.images_seen += len(x)
        return super().forward_intermediates(x, indices, intermediates_only)


def test_a_bank_that_would_not_fit_stops_before_any_feature_pass(tmp_path, monkeypatch):
    free = {"cpu": 4000}  # bytes: 48 rows x (12 x 4 + 8) = 2688 fit, the queries and scoring do not
    monkeypatch.setattr(knn_bank, "free_bytes", lambda device: free[torch.device(device).type])
    model = CountedNet()
    trainer = tiny_trainer(tmp_path, [KNNEvaluator(k=5, scoring_mib=1)], max_epochs=1, limit_train_batches=2)
    with pytest.raises(BankTooLarge) as err:
        trainer.fit(model, datamodule=TinyData())
    message = str(err.value)
    assert "\n" not in message and "48 images / 1 ranks x 12 features over 1 banks x float32" in message
    # the fixes that apply: the bank is already in host memory, there is one bank (no blocks)
    assert message.endswith("set bank_dtype: float16 (half the bank), scoring_mib lower, or run on more ranks")
    assert model.images_seen == 1  # the width, learnt from one image; no training step, no pass
    free["cpu"] = 2 ** 40
    trainer = tiny_trainer(tmp_path, [KNNEvaluator(k=5, scoring_mib=1)], max_epochs=1, limit_train_batches=2)
    trainer.fit(CountedNet(), datamodule=TinyData())  # with room, the same run goes through


def test_the_cli_names_the_fix_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(knn_bank, "free_bytes", lambda device: 2 ** 20)
    with pytest.raises(SystemExit) as exit_:
        cli.console_main(["fit", "--config", "configs/digits_mae.yaml", "--trainer.max_epochs=1",
                  "--trainer.limit_train_batches=2", "--trainer.enable_progress_bar=false",
                  f"--trainer.default_root_dir={tmp_path}", "--model.network.depth=2", "--model.network.decoder_depth=1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("shortcutlab: error: KNNEvaluator: the bank needs ") and "bank_dtype" in err[-1]


@pytest.fixture
def rich_console_restored():
    """RichProgressBar reconfigures rich's global console in place (its console_kwargs): put it
    back, so that later tests on this worker print where they expect."""
    import rich

    saved = dict(rich.get_console().__dict__)
    yield
    rich.get_console().__dict__ = saved


def test_each_pass_shows_a_bar_in_the_rich_display_and_logs_its_duration(tmp_path, caplog, rich_console_restored):
    screen = io.StringIO()
    bar = RichProgressBar(console_kwargs={"file": screen, "force_terminal": True, "width": 160})
    trainer = tiny_trainer(tmp_path, [bar, KNNEvaluator(k=5)], max_epochs=1, limit_train_batches=2,
                           enable_progress_bar=True, num_sanity_val_steps=0)
    with caplog.at_level(logging.INFO):
        trainer.fit(TinyNet(), datamodule=TinyData())
    drawn = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue()).replace("\r", "\n")
    # the pass's task advanced batch by batch to its end: 48 bank images and 21 queries in batches of 8
    assert re.search(r"KNNEvaluator: bank_dataset \S+ 6/6 ", drawn), drawn[-2000:]
    assert re.search(r"KNNEvaluator: val_dataset \S+ 3/3 ", drawn)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KNNEvaluator: ")]
    assert lines[0].startswith("KNNEvaluator: bank_dataset, 48 images in ") and lines[0].endswith(" s")
    assert lines[1].startswith("KNNEvaluator: val_dataset, 21 images in ")


def test_without_the_progress_bar_a_pass_draws_nothing_but_still_logs(tmp_path, caplog, capsys):
    trainer = tiny_trainer(tmp_path, [KNNEvaluator(k=5)], max_epochs=1, limit_train_batches=2, num_sanity_val_steps=0)
    with caplog.at_level(logging.INFO):
        trainer.fit(TinyNet(), datamodule=TinyData())
    assert trainer.progress_bar_callback is None
    assert "bank_dataset" not in capsys.readouterr().err
    assert any(r.getMessage().startswith("KNNEvaluator: bank_dataset, 48 images in ") for r in caplog.records)


def test_the_documented_error_line_is_the_one_a_run_prints(monkeypatch):
    """docs/multi-gpu.md's example: ViT-B/16, ImageNet-1K, every block, one GPU with 38.2 GiB free."""
    from pathlib import Path

    monkeypatch.setattr(knn_bank, "free_bytes", lambda device: int(38.2 * 2 ** 30))
    line = knn_bank.bank_shortage("KNNEvaluator", 1_281_167, 1, 1, [768] * 13, torch.float32, torch.device("cuda", 0),
                                  50_000, torch.device("cuda", 0), 256 * 2 ** 20)
    page = (Path(__file__).resolve().parents[2] / "docs" / "multi-gpu.md").read_text()
    assert f"shortcutlab: error: {line}\n" in page


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_bank_read_in_parts_finds_the_neighbours_numpy_finds(dtype):
    """A bank in another dtype or on another device is brought to the queries a few rows at a
    time (here 5 rows a copy): the neighbours of the parts, merged, are those of the whole bank
    (float64 numpy on the stored values)."""
    import numpy as np

    from callbacks.measurement.knn_scoring import local_neighbours, normalized_queries

    g = torch.Generator().manual_seed(3)
    bank = torch.nn.functional.normalize(torch.randn(37, 6, generator=g), dim=1).to(dtype)
    labels, queries = torch.arange(37), normalized_queries(torch.randn(9, 6, generator=g), torch.device("cpu"))
    sims, found, index = local_neighbours(bank, labels, queries, 7, budget_bytes=2 * 5 * 6 * 4)
    assert torch.equal(found, index)  # the labels are the rows' indices
    expected = np.argsort(-(queries.double().numpy() @ bank.double().numpy().T), axis=1, kind="stable")[:, :7]
    assert found.tolist() == expected.tolist()
    torch.testing.assert_close(sims.double(), (queries.double() @ bank.double().T).gather(1, found), rtol=0, atol=1e-6)
