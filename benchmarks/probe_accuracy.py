"""The shipped online probe's accuracy against lightly's every-batch probe on the quickstart
(issue 18, item 2): one full quickstart pre-training (configs/digits_mae.yaml's model, data,
seed and 100 epochs, validation every 25) with both probes in the same Trainer. The probes
never change the pre-training (they run on detached features with forked RNG streams), so
both heads see the same network at every step and differ only by their cadence.

This is an accuracy figure, not a timing: it runs once, in full mode only (about 4 minutes
on 2 CPU cores: the every-batch probe costs half a training step per batch).
"""
from __future__ import annotations

import os
import tempfile

from lightning.pytorch import seed_everything

from callbacks.online_probe import OnlineLinearProbe
from lightning_mods import metric_names

from .settings import Settings
from .timing import Row, skipped
from .training import SHIPPED_EPOCHS, SHIPPED_EVAL_EVERY, quickstart_data, quickstart_model, quiet, trainer

SECTION = "online probe accuracy on the quickstart"
EVERY_BATCH_RATES = [1e-2, 1e-3]  # the shipped rate, and the every-batch probe's earlier default
EVERY_BATCH = dict(every_n_steps=1, max_samples=None, replay_samples=None, lr=EVERY_BATCH_RATES,
                   name="every_batch")  # lightly's cadence: one step on each fresh batch


def probe_val_top1(probe: OnlineLinearProbe, metrics: dict) -> list[float]:
    """The final ``online_probe/val_top1`` of each of the probe's heads (one per rate)."""
    return [float(metrics[name]) for name in probe.metric_names_of(metric_names.ONLINE_PROBE_VAL_TOP1)]


def run(settings: Settings, candidates: dict[str, dict] | None = None) -> list[Row]:
    if settings.quick:
        return [skipped(SECTION, "shipped probe - every-batch probe, val top-1", "quick mode (a 100-epoch run)")]
    shipped = OnlineLinearProbe(name="shipped")
    reference = OnlineLinearProbe(**EVERY_BATCH)
    others = {label: OnlineLinearProbe(name=label, **kwargs) for label, kwargs in (candidates or {}).items()}
    with quiet(), tempfile.TemporaryDirectory() as root:
        seed_everything(0, verbose=False)
        model = quickstart_model(settings)
        model.hparams.num_reconstructions = 0
        tr = trainer(settings, os.path.join(root, "probes"), [shipped, reference, *others.values()],
                     SHIPPED_EPOCHS, SHIPPED_EVAL_EVERY)
        tr.fit(model, datamodule=quickstart_data(settings))
        metrics = dict(tr.callback_metrics)
    ours = probe_val_top1(shipped, metrics)[0]
    same_rate, earlier = probe_val_top1(reference, metrics)
    cadence = f"every {shipped.every_n_steps} steps, {shipped.max_samples} images, lr {shipped.lr:g}"
    rows = [Row(SECTION, "shipped probe - every-batch probe at the same lr (1e-2), final val top-1",
                100 * (ours - same_rate), 100 * (ours - same_rate), ">= -2", "points",
                f"shipped ({cadence}) {100 * ours:.1f} %, every batch (all 128 images) {100 * same_rate:.1f} % "
                f"after {SHIPPED_EPOCHS} epochs"),
            Row(SECTION, "shipped probe - every-batch probe at lr 1e-3 (its earlier default)", 100 * (ours - earlier),
                100 * (ours - earlier), None, "points", f"every batch at lr 1e-3: {100 * earlier:.1f} %")]
    for label, probe in others.items():
        value = probe_val_top1(probe, metrics)[0]
        rows.append(Row(SECTION, f"{label} - every-batch probe at 1e-2 (points)", 100 * (value - same_rate),
                        100 * (value - same_rate), None, "points", f"{label} {100 * value:.1f} %"))
    return rows
