"""``shortcutlab score-bank`` as docs/multi-gpu.md shows it: a validate that saves the bank of a
quickstart checkpoint, then the command on the saved files, whose figures at the quickstart
kNN's own settings equal what that kNN logged in the same validate."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from commands import lightning_cli as cli
from commands import score_bank

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "multi-gpu.md"
SMALL = ["--model.network.depth=2", "--model.network.decoder_depth=1", "--trainer.enable_progress_bar=false"]


def documented_lines() -> list[list[str]]:
    """The two commands of the page's 'Scoring a saved bank again' block."""
    text = PAGE.read_text()
    block = re.search(r"tests/commands/test_score_bank\.py[^\n]*\n```bash\n(.*?)```", text, re.S).group(1)
    return [shlex.split(line) for line in block.strip().splitlines()]


@pytest.mark.slow
def test_the_documented_commands_score_a_saved_bank_as_a_run_does(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    cli.main(["fit", "--config", "configs/digits_mae.yaml", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
              "--trainer.limit_val_batches=1", *SMALL])
    validate, knn = documented_lines()
    assert validate[:2] == ["shortcutlab", "validate"] and knn[:2] == ["shortcutlab", "score-bank"]
    trainer = cli.main(validate[1:] + SMALL).trainer
    capsys.readouterr()
    score_bank.main(knn[2:])
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [f"top{t}@k={k}" for k in (10, 20, 100, 200) for t in (1, 5)]
    assert [line.split()[0] for line in table[1:]] == ["features"] + ["block"] * 2  # depth 2
    # at the settings of the quickstart's own kNN (k=20, T=0.07), the saved bank gives what that kNN logged
    logged = float(trainer.callback_metrics["knn/top1"])
    saved = dict(score_bank.score(tmp_path / "runs/digits_mae/bank", [20], 0.07, None, 2 ** 24))
    assert round(saved["features"]["top1@k=20"] * 360) == round(logged * 360)
    # on the device --device names (auto: the CPU here, a GPU where there is one): the same figures
    for device in ("cpu", "auto"):
        assert dict(score_bank.score(tmp_path / "runs/digits_mae/bank", [20], 0.07, None, 2 ** 24,
                                     device=device)) == saved
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as stop:
            score_bank.main([str(tmp_path / "runs/digits_mae/bank"), "--device", "cuda"])
        assert stop.value.code == 2
        assert capsys.readouterr().err == ("shortcutlab score-bank: error: --device cuda: no such CUDA device here "
                                           "(0 visible)\n")
    with pytest.raises(SystemExit):
        score_bank.main([str(tmp_path / "runs/digits_mae/bank"), "--device", "tpu"])
    assert "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'" in capsys.readouterr().err
