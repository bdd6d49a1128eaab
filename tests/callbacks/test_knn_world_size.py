"""kNN accuracy does not depend on the number of processes: at 1, 2 and 3 real processes (gloo,
torchrun) the same weights give the same kNN numbers to the last digit, on bank features with exact
ties at the k-th neighbour (decided by the bank index, as float64 numpy's stable sort decides them)
and on the quickstart network, whose near-collapsed features put many neighbours within rounding
of each other (every block, several k)."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer

from callbacks.measurement.knn import KNNEvaluator
from helpers import folders
from helpers.tiny_runs import Passthrough, TinyData

BANK, QUERIES, CLASSES, DIM, BATCH = 103, 29, 7, 8, 8


class TiedFeatures(Passthrough):
    """``sign(x A)`` in 3 dimensions: at most 8 distinct features over 103 bank rows, so almost every
    query's k-th neighbour is tied with bank rows of other classes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.randn(DIM, 3, generator=torch.Generator().manual_seed(5)))

    def forward_features(self, x):  # noqa: ANN001
        return torch.sign(x @ self.a)


def tied_data() -> TinyData:
    return TinyData(n_train=BANK, n_val=QUERIES, num_classes=CLASSES, dim=DIM, batch_size=BATCH, spread=2.5)


def quickstart_parts(weights: Optional[str] = None):  # noqa: ANN201
    """The quickstart's MAE (its config's encoder, one decoder block) with the weights in ``weights``
    (None: as initialised, seeded by the caller), and the digits."""
    from datamodules.digits import Digits
    from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
    from lightning_mods.backbone.shortcut import ShortcutSchedule
    from lightning_mods.mae import MaskedAutoencoder

    network = MaskedAutoencoderViT(img_size=16, in_chans=1, patch_size=4, embed_dim=96, depth=12, num_heads=3,
                                   decoder_embed_dim=64, decoder_depth=1, decoder_num_heads=4,
                                   shortcut=ShortcutSchedule(kind="linear", alpha_min=0.6))
    module = MaskedAutoencoder(network=network)
    if weights is not None:
        module.load_state_dict(torch.load(weights, weights_only=True))
    return module, Digits(batch_size=128, image_size=16)


def evaluate(weights: str, root: Path) -> dict:
    """The logged kNN numbers and per-block rows of both evaluations, in this process's world."""
    devices = int(os.environ.get("WORLD_SIZE", "1"))
    seen = {}
    for name, (module, data), callbacks in (
            ("tied", (TiedFeatures(), tied_data()), [KNNEvaluator(k=[1, 5, 20], name="k"),
                                                     KNNEvaluator(k=5, bank_dtype="float16", name="half")]),
            ("quickstart", quickstart_parts(weights), [KNNEvaluator(k=[5, 20], blocks="all")])):
        trainer = Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                          default_root_dir=root / name)
        trainer.validate(module, datamodule=data, verbose=False)
        seen[name] = {"metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("knn/")},
                      "blocks": [row for cb in callbacks for row in cb._block_values]}
    return seen


SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    from pathlib import Path
    sys.path[:0] = {tests!r}
    warnings.filterwarnings("ignore")
    from commands import reproducible_cpu
    reproducible_cpu.finish()
    from test_knn_world_size import evaluate

    out = Path(sys.argv[1])
    seen = evaluate(sys.argv[2], out)
    (out / f"rank{{os.environ['RANK']}}.json").write_text(json.dumps(seen))
""")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm_shortcutlab) -> dict[int, list[dict]]:
    """What every rank logged at 1 (this process), 2 and 3 processes (warm forks)."""
    from test_callbacks_ddp import ranks_seen

    root = tmp_path_factory.mktemp("knn_world_size")
    torch.manual_seed(0)
    weights = root / "quickstart.pt"
    # a few steps of training from the quickstart's initialisation (zero-initialised branches)
    module, data = quickstart_parts()
    data.setup("fit")
    optimizer = torch.optim.AdamW(module.parameters(), lr=1.5e-3)
    for step, (images, _) in zip(range(3), torch.utils.data.DataLoader(data.train_dataset, batch_size=128)):
        loss, _, _ = module(images)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save(module.state_dict(), weights)
    script = root / "run.py"
    script.write_text(SCRIPT.format(tests=folders.PATHS))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folders.REPO), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="")
    found = {1: [evaluate(str(weights), root / "w1")]}
    for devices in (2, 3):
        found[devices] = ranks_seen(script, root / f"w{devices}", devices, [str(weights)], warm_shortcutlab, env)
    return found


def numpy_accuracy(k: int, top: int) -> float:
    """Weighted kNN of the tied features in float64 numpy, neighbours ordered by similarity and
    then by bank index (a stable sort), as the package promises."""
    data, module = tied_data(), TiedFeatures()
    bank_x, bank_y = (t.numpy() for t in data.bank_dataset.tensors)
    val_x, val_y = (t.numpy() for t in data.val_dataset.tensors)
    a = module.a.double().numpy()

    def unit(x):  # noqa: ANN001, ANN202
        f = np.sign(x.astype(np.float64) @ a)
        return f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)
    sims = unit(val_x) @ unit(bank_x).T
    hits = 0
    for row, label in zip(sims, val_y):
        near = np.argsort(-row, kind="stable")[:k]
        scores = np.zeros(CLASSES)
        np.add.at(scores, bank_y[near], np.exp(row[near] / 0.07))
        ranking = np.argsort(-scores, kind="stable")[:top]
        hits += int(label in ranking and scores[label] > 0)
    return hits / len(val_y)


def hits(accuracy: float) -> int:
    """The queries an accuracy counts (the logged values are float32)."""
    return round(accuracy * QUERIES)


@pytest.mark.slow
def test_every_world_size_logs_the_same_knn_numbers_to_the_last_digit(runs):
    one = runs[1][0]
    assert one["quickstart"]["blocks"] and len(one["quickstart"]["blocks"]) == 12
    for devices in (2, 3):
        for rank in runs[devices]:
            assert rank == one, devices  # every metric and every block's row, as floats


@pytest.mark.slow
def test_ties_at_the_kth_neighbour_go_to_the_lower_bank_index(runs):
    metrics = runs[1][0]["tied"]["metrics"]
    for k in (1, 5, 20):
        for top in (1, 5):
            assert hits(metrics[f"knn/top{top}@k,k={k}"]) == hits(numpy_accuracy(k, top)), (k, top)
    assert hits(metrics["knn/top1@half"]) == hits(numpy_accuracy(5, 1))
