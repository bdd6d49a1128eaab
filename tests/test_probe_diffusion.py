"""The blocks x noise levels probe of diffusion features (SPEC section 3, "the paper reports the
best layer/noise pair"): the sweep finds the informative pair, the command writes its outputs."""
import csv
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from lightning_mods.probe_diffusion import best_pair, main, probe_sweep, write_results

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits_diffusion_quick.yaml"


class InformativeAt:
    """Stub: block 1 at timesteps below 100 sees the one-hot label; everything else is noise."""

    def noised_block_features(self, images, blocks, timestep, seed=0):
        noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(seed))
        return [images if (b == 1 and timestep < 100) else noise for b in blocks]


def test_sweep_reports_the_informative_block_and_noise_level(tmp_path):
    labels = torch.arange(120) % 4
    one_hot = torch.nn.functional.one_hot(labels, 4).float() * 3.0
    train = DataLoader(TensorDataset(one_hot[:80], labels[:80]), batch_size=32)
    val = DataLoader(TensorDataset(one_hot[80:], labels[80:]), batch_size=32)
    rows = probe_sweep(InformativeAt(), train, val, blocks=[0, 1, 2], timesteps=[10, 500], num_classes=4,
                       probe_epochs=15, probe_lr=0.1, probe_batch_size=40)
    assert len(rows) == 6
    by_pair = {(r["block"], r["timestep"]): r for r in rows}
    assert by_pair[(1, 10)]["linear_top1"] == 1.0 and by_pair[(1, 10)]["knn_top1"] == 1.0
    assert max(r["linear_top1"] for k, r in by_pair.items() if k != (1, 10)) < 0.75
    best = best_pair(rows)
    assert (best["block"], best["timestep"]) == (1, 10)
    paths = write_results(rows, str(tmp_path))
    text = Path(paths["markdown"]).read_text()
    assert "block 1, t=10" in text and "100.00" in text


def test_command_writes_table_and_heatmaps(tmp_path):
    rows = main(["--config", str(CONFIG), "--out", str(tmp_path), "--blocks", "0", "3", "6", "--timesteps", "10",
                 "200", "--max-train", "150", "--max-val", "60", "--probe-epochs", "3", "--device", "cpu",
                 "--model.init_args.depth=6"])
    assert len(rows) == 6
    with open(tmp_path / "probe_results.csv") as f:
        table = list(csv.DictReader(f))
    assert [(int(r["block"]), int(r["timestep"])) for r in table] == [(b, t) for t in (10, 200) for b in (0, 3, 6)]
    for name in ("probe_heatmap_linear.png", "probe_heatmap_knn.png"):
        picture = np.asarray(Image.open(tmp_path / name))
        assert picture.ndim == 3 and picture.shape[2] >= 3 and picture.std() > 0
    best = best_pair(rows)
    assert f"block {best['block']}, t={best['timestep']}" in (tmp_path / "probe_results.md").read_text()
