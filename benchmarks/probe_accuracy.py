"""The shipped online probe's accuracy against lightly's every-batch probe on the quickstart:
one full quickstart pre-training (configs/digits_mae.yaml's model, data,
seed and 100 epochs, validation every 25) with both probes in the same Trainer. The probes
never change the pre-training (they run on detached features with forked RNG streams), so
both heads see the same network at every step and differ only by their cadence.

The every-batch probe runs at the shipped rate (the goal's comparison), at the earlier default
1e-2 and at 3e-2, the best of the three for it (one forward feeds its three heads). This is an
accuracy figure, not a timing: it runs once, in full mode only (about 4 minutes on 2 CPU cores:
the every-batch probe costs half a training step per batch).
"""
from __future__ import annotations

import os
import tempfile

from lightning.pytorch import seed_everything

from callbacks.measurement.online_probe import LinearHeads, OnlineLinearProbe
from lightning_mods.evaluation import metric_names

from .settings import Settings
from .timing import Row, skipped
from .quickstart_training import SHIPPED_EPOCHS, SHIPPED_EVAL_EVERY, quickstart_data, quickstart_model, quiet, trainer

SECTION = "online probe accuracy on the quickstart"
EARLIER_RATE = 1e-2  # the probe's default before this comparison moved it to 2e-2
HIGHER_RATE = 3e-2  # the best of the every-batch probe's rates tried (1e-2, 2e-2, 3e-2)


def every_batch_settings(shipped_lr: float) -> dict:
    """lightly's cadence (one step on each fresh batch, no replay) at the shipped rate first,
    then the earlier default and a higher rate: one forward per batch feeds the three heads."""
    return dict(every_n_steps=1, max_samples=None, replay=None,
                heads=LinearHeads(lr=[shipped_lr, EARLIER_RATE, HIGHER_RATE]), name="every_batch")


def probe_val_top1(probe: OnlineLinearProbe, metrics: dict) -> list[float]:
    """The final ``online_probe/val_top1`` of each of the probe's heads (one per rate)."""
    return [float(metrics[name]) for name in probe.metric_names_of(metric_names.ONLINE_PROBE_VAL_TOP1)]


def run(settings: Settings, candidates: dict[str, dict] | None = None) -> list[Row]:
    if settings.quick:
        return [skipped(SECTION, "shipped probe - every-batch probe, val top-1", "quick mode (a 100-epoch run)")]
    shipped = OnlineLinearProbe(name="shipped")
    reference = OnlineLinearProbe(**every_batch_settings(shipped.lrs[0]))
    others = {label: OnlineLinearProbe(name=label, **kwargs) for label, kwargs in (candidates or {}).items()}
    with quiet(), tempfile.TemporaryDirectory() as root:
        seed_everything(0, verbose=False)
        model = quickstart_model(settings, num_reconstructions=0)
        tr = trainer(settings, os.path.join(root, "probes"), [shipped, reference, *others.values()],
                     SHIPPED_EPOCHS, SHIPPED_EVAL_EVERY)
        tr.fit(model, datamodule=quickstart_data(settings))
        metrics = dict(tr.callback_metrics)
    ours = probe_val_top1(shipped, metrics)[0]
    same_rate, earlier, higher = probe_val_top1(reference, metrics)
    cadence = f"every {shipped.every_n_steps} steps, {shipped.max_samples} images, lr {shipped.lrs[0]:g}"
    rows = [Row(SECTION, f"shipped probe - every-batch probe at the same lr ({shipped.lrs[0]:g}), final val top-1",
                100 * (ours - same_rate), 100 * (ours - same_rate), ">= -2", "points",
                f"shipped ({cadence}) {100 * ours:.1f} %, every batch (all 128 images) {100 * same_rate:.1f} % "
                f"after {SHIPPED_EPOCHS} epochs"),
            Row(SECTION, f"shipped probe - every-batch probe at lr {EARLIER_RATE:g} (the earlier default)",
                100 * (ours - earlier), 100 * (ours - earlier), None, "points",
                f"every batch at lr {EARLIER_RATE:g}: {100 * earlier:.1f} %"),
            Row(SECTION, f"shipped probe - every-batch probe at lr {HIGHER_RATE:g} (its best rate tried)",
                100 * (ours - higher), 100 * (ours - higher), None, "points",
                f"every batch at lr {HIGHER_RATE:g}: {100 * higher:.1f} %")]
    for label, probe in others.items():
        value = probe_val_top1(probe, metrics)[0]
        rows.append(Row(SECTION, f"{label} - every-batch probe at {shipped.lrs[0]:g} (points)", 100 * (value - same_rate),
                        100 * (value - same_rate), None, "points", f"{label} {100 * value:.1f} %"))
    return rows
