"""What evaluation over depth costs: kNN at all 12 blocks of a ViT-Tiny MAE against
kNN at its evaluation features alone, the online probe with a head per block against one head,
and the patch-feature picture's share of a quickstart evaluation. Each pair runs in one fit
(two callbacks, each timed around its own hook), so every round compares them on the same weights.
"""
from __future__ import annotations

import tempfile

from lightning.pytorch import seed_everything

from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.online_probe import DepthHeads, OnlineLinearProbe
from callbacks.measurement.effective_rank import EffectiveRank
from callbacks.measurement.patch_features import PatchFeaturePicture
from lightning_mods.mae import MaskedAutoencoder

from .hook_clock import HookClock
from .several_settings import UnsharedKNN, clocked
from .settings import Settings
from .timing import Row, ratio_row
from .quickstart_training import quickstart_data, quickstart_model, quiet, trainer


def vit_tiny_mae(settings: Settings) -> MaskedAutoencoder:
    """The quickstart's MAE at ViT-Tiny's width (192; 12 blocks, 3 heads as the quickstart), a
    2-block decoder, no reconstruction pictures."""
    return quickstart_model(settings, embed_dim=192, decoder_depth=2, num_reconstructions=0)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run(settings: Settings) -> list[Row]:
    section = "evaluation over depth"
    epochs = settings.pick(max(3, settings.rounds), 1)
    with quiet(), tempfile.TemporaryDirectory() as root:
        # the same logged names (blocks adds rows over depth only): told apart by a name
        pairs = HookClock()
        callbacks = clocked(pairs, one=UnsharedKNN(every_n_epochs=1),
                            every=UnsharedKNN(every_n_epochs=1, blocks="all", name="blocks"),
                            one_head=OnlineLinearProbe(every_n_steps=1, max_samples=32),
                            block_heads=OnlineLinearProbe(every_n_steps=1, max_samples=32, depth=DepthHeads("all"),
                                                          name="blocks"))
        seed_everything(0, verbose=False)
        tr = trainer(settings, root, callbacks, epochs + 1, 1, logger=False)
        tr.fit(vit_tiny_mae(settings), datamodule=quickstart_data(settings))
        every_knn = callbacks[1]
        # the quickstart's evaluation as it runs: kNN, rank and probe share their feature passes
        clock, picture = HookClock(), PatchFeaturePicture(every_n_epochs=1)
        clock.watch("picture", picture, ["on_validation_epoch_end"])
        clock.span("validation", "on_validation_start", "on_validation_end")
        shipped = [picture, EffectiveRank(every_n_epochs=1, per_block=True), KNNEvaluator(every_n_epochs=1, blocks="all"),
                   OnlineLinearProbe(depth=DepthHeads("all")), clock]
        seed_everything(0, verbose=False)
        tr = trainer(settings, root, shipped, epochs + 1, 1, logger=False)
        tr.fit(quickstart_model(settings), datamodule=quickstart_data(settings))
    one, every = pairs.per_call("one"), pairs.per_call("every")
    one_head, block_heads = (pairs.per_epoch(name, None, epochs + 1) for name in ("one_head", "block_heads"))
    pictures, validations = clock.per_call("picture"), clock.per_call("validation")
    blocks = len(every_knn._block_values) or 1
    knn = [b / a for a, b in zip(one[1:], every[1:])] or [every[0] / one[0]]
    heads = [b / a for a, b in zip(one_head[1:], block_heads[1:])] or [block_heads[0] / one_head[0]]
    share = [p / c for p, c in zip(pictures[1:], validations[1:])] or [pictures[0] / validations[0]]
    return [
        ratio_row(section, f"kNN at all {blocks} blocks + the features / the features alone (ViT-Tiny MAE)", knn,
                  "<= 3.0", f"one forward pass for every block; the features alone take {1e3 * median(one):.0f} ms"),
        ratio_row(section, f"online probe with {blocks} block heads + 1 / 1 head (its training hook, every batch)",
                  heads, "<= 1.5", f"one forward of 32 images feeds every head; 1 head takes "
                                   f"{1e3 * median(one_head):.0f} ms/epoch"),
        ratio_row(section, "patch-feature picture / a quickstart evaluation (validation with every callback)",
                  share, "<= 0.05", f"8 images; an evaluation takes {1e3 * median(validations):.0f} ms", unit="share"),
    ]
