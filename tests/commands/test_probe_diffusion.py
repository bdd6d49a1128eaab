"""The blocks x noise levels probe of diffusion features (the decay paper, section 5, "the paper reports the
best layer/noise pair"): the sweep finds the informative pair, the command writes its outputs."""
import csv
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from rich.console import Console
from rich.progress import Progress
from torch.utils.data import DataLoader, TensorDataset

from commands.probe_diffusion import best_pair, main, probe_sweep, write_results
from lightning_mods.backbone.uvit import UViT

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_diffusion_quick.yaml"


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
    progress = Progress(console=Console(file=io.StringIO()))
    rows = probe_sweep(InformativeAt(), train, val, blocks=[0, 1, 2], timesteps=[10, 500], num_classes=4,
                       probe_epochs=15, probe_lr=0.1, probe_batch_size=40, progress=progress)
    assert len(rows) == 6
    # one bar over the 6 pairs stays; the bars over each feature pass were removed when done
    assert [(t.completed, t.total) for t in progress.tasks] == [(6, 6)]
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
                 "--model.network.depth=6"])
    assert len(rows) == 6
    with open(tmp_path / "probe_results.csv") as f:
        table = list(csv.DictReader(f))
    assert [(int(r["block"]), int(r["timestep"])) for r in table] == [(b, t) for t in (10, 200) for b in (0, 3, 6)]
    for name in ("probe_heatmap_linear.png", "probe_heatmap_knn.png"):
        picture = np.asarray(Image.open(tmp_path / name))
        assert picture.ndim == 3 and picture.shape[2] >= 3 and picture.std() > 0
    best = best_pair(rows)
    assert f"block {best['block']}, t={best['timestep']}" in (tmp_path / "probe_results.md").read_text()


def test_linear_probe_of_a_diffusion_backbone_takes_the_datamodules_pixel_statistics(tmp_path):
    """The offline LinearProbe loads only weights: a pixel-space U-ViT must still normalise its
    input with the datamodule's mean/std (as in pre-training), not the [0.5] fallback."""
    from lightning import Trainer

    from datamodules.digits import Digits
    from lightning_mods.diffusion import DiffusionModule
    from lightning_mods.linear_probe import LinearProbe

    backbone = DiffusionModule(UViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=1, num_heads=2, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}), num_sample_images=0)
    probe = LinearProbe(backbone=backbone, num_classes=10)
    data = Digits(batch_size=32, image_size=8)
    trainer = Trainer(max_steps=1, limit_val_batches=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(probe, datamodule=data)
    data_mean = [float(v) for v in data.mean]
    assert data_mean != [0.5]
    np.testing.assert_allclose(backbone.hparams.pixel_mean, data_mean)
    np.testing.assert_allclose(backbone.hparams.pixel_std, [float(v) for v in data.std])


def test_topk_accuracy_on_hand_built_scores():
    from lightning_mods.linear_probe import topk_accuracy

    scores = torch.tensor([[0.1, 0.7, 0.2],   # label 1: top-1 hit
                           [0.5, 0.3, 0.2],   # label 1: second best
                           [0.2, 0.3, 0.5],   # label 0: last
                           [0.6, 0.1, 0.3]])  # label 2: second best
    labels = torch.tensor([1, 1, 0, 2])
    assert topk_accuracy(scores, labels, 1) == 0.25
    assert topk_accuracy(scores, labels, 2) == 0.75
    assert topk_accuracy(scores, labels, 5) == 1.0  # k capped at the 3 classes
