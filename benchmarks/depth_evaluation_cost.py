"""What evaluation over depth costs: kNN at all 12 blocks of a ViT-Tiny MAE against
kNN at its evaluation features alone, the online probe with a head per block against one head,
and the patch-feature picture's share of a quickstart evaluation. Each pair runs in one fit
(two callbacks, each timed around its own hook), so every round compares them on the same weights.
"""
from __future__ import annotations

import tempfile
import time
from typing import Any

from lightning.pytorch import Callback, seed_everything

from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.online_probe import OnlineLinearProbe
from callbacks.measurement.effective_rank import EffectiveRank
from callbacks.measurement.patch_features import PatchFeaturePicture
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.mae import MaskedAutoencoder

from .several_settings import TimedKNN, TimedProbe
from .settings import Settings
from .timing import Row, ratio_row, synchronize
from .quickstart_training import quickstart_data, quickstart_model, quiet, trainer


class TimedPicture(PatchFeaturePicture):
    """A PatchFeaturePicture that records the seconds of each of its pictures."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds: list[float] = []

    def on_validation_epoch_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        synchronize(pl_module.device)
        start = time.perf_counter()
        super().on_validation_epoch_end(trainer, pl_module)
        synchronize(pl_module.device)
        self.seconds.append(time.perf_counter() - start)


class ValidationClock(Callback):
    """Seconds of each validation, from its first hook to its last (every callback's work included)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._start = 0.0

    def on_validation_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        synchronize(pl_module.device)
        self.seconds.append(time.perf_counter() - self._start)


def vit_tiny_mae(settings: Settings) -> MaskedAutoencoder:
    """ViT-Tiny (width 192, 12 blocks, 3 heads) as an MAE on the 16x16 digits, 4x4 patches."""
    size = settings.pick(dict(embed_dim=192, depth=12, num_heads=3), dict(embed_dim=16, depth=2, num_heads=2))
    return MaskedAutoencoder(image_size=16, in_chans=1, patch_size=4, decoder_embed_dim=64, decoder_depth=2,
                             decoder_num_heads=4, shortcut=ShortcutSchedule("linear", 0.6), num_reconstructions=0,
                             **size)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run(settings: Settings) -> list[Row]:
    section = "evaluation over depth"
    epochs = settings.pick(max(3, settings.rounds), 1)
    with quiet(), tempfile.TemporaryDirectory() as root:
        # the same logged names (blocks adds rows over depth only): told apart by a name
        one, every = TimedKNN(every_n_epochs=1), TimedKNN(every_n_epochs=1, blocks="all", name="blocks")
        one_head = TimedProbe(every_n_steps=1, max_samples=32)
        block_heads = TimedProbe(every_n_steps=1, max_samples=32, blocks="all", name="blocks")
        seed_everything(0, verbose=False)
        tr = trainer(settings, root, [one, every, one_head, block_heads], epochs + 1, 1, logger=False)
        tr.fit(vit_tiny_mae(settings), datamodule=quickstart_data(settings))
        picture, clock = TimedPicture(every_n_epochs=1), ValidationClock()
        # the quickstart's evaluation as it runs: kNN, rank and probe share their feature passes
        shipped = [picture, EffectiveRank(every_n_epochs=1, per_block=True), KNNEvaluator(every_n_epochs=1, blocks="all"),
                   OnlineLinearProbe(blocks="all"), clock]
        seed_everything(0, verbose=False)
        tr = trainer(settings, root, shipped, epochs + 1, 1, logger=False)
        tr.fit(quickstart_model(settings), datamodule=quickstart_data(settings))
    blocks = len(every._block_values) or 1
    knn = [b / a for a, b in zip(one.seconds[1:], every.seconds[1:])] or [every.seconds[0] / one.seconds[0]]
    heads = [b / a for a, b in zip(one_head.seconds[1:], block_heads.seconds[1:])] or \
        [block_heads.seconds[0] / one_head.seconds[0]]
    share = [p / c for p, c in zip(picture.seconds[1:], clock.seconds[1:])] or [picture.seconds[0] / clock.seconds[0]]
    return [
        ratio_row(section, f"kNN at all {blocks} blocks + the features / the features alone (ViT-Tiny MAE)", knn,
                  "<= 3.0", f"one forward pass for every block; the features alone take {1e3 * median(one.seconds):.0f} ms"),
        ratio_row(section, f"online probe with {blocks} block heads + 1 / 1 head (its training hook, every batch)",
                  heads, "<= 1.5", f"one forward of 32 images feeds every head; 1 head takes "
                                   f"{1e3 * median(one_head.seconds):.0f} ms/epoch"),
        ratio_row(section, "patch-feature picture / a quickstart evaluation (validation with every callback)",
                  share, "<= 0.05", f"8 images; an evaluation takes {1e3 * median(clock.seconds):.0f} ms", unit="share"),
    ]
