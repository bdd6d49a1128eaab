"""What measuring at several settings in one pass costs: ``KNNEvaluator(k=[10, 20, 100,
200])`` against ``KNNEvaluator(k=20)``, and ``OnlineLinearProbe`` with four rates against one, on
the quickstart's MAE and digits. Both variants run in the same fit (two callbacks of one class
in one Trainer), each timed around its own hook, so every round pairs them on the same weights.
"""
from __future__ import annotations

import tempfile
from typing import Any

from lightning.pytorch import seed_everything

from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.shared_features import SharedEvaluation
from callbacks.measurement.online_probe import LinearHeads, OnlineLinearProbe

from .settings import Settings
from .hook_clock import HookClock
from .timing import Row, ratio_row
from .quickstart_training import quickstart_data, quickstart_model, quiet, trainer

FOUR_K = [10, 20, 100, 200]  # DINO's
FOUR_RATES = [1e-3, 3e-3, 1e-2, 3e-2]


class UnsharedKNN(KNNEvaluator):
    """A KNNEvaluator that runs its own feature passes, as if it were the only evaluation."""

    def evaluate(self, trainer, pl_module):  # noqa: ANN001, ANN201
        with SharedEvaluation.of(trainer).unshared():
            return super().evaluate(trainer, pl_module)


def clocked(clock: HookClock, **timed: Any) -> list:
    """The callbacks ``timed`` (name -> callback), each watched by ``clock`` under its name: a
    kNN's evaluations, a probe's training hook; then the clock itself."""
    for name, callback in timed.items():
        clock.watch(name, callback, ["evaluate"] if isinstance(callback, KNNEvaluator) else ["on_train_batch_end"])
    return [*timed.values(), clock]


def run(settings: Settings) -> list[Row]:
    section = "several settings in one pass"
    epochs = settings.pick(max(3, settings.rounds), 1)
    with quiet(), tempfile.TemporaryDirectory() as root:
        clock = HookClock()
        callbacks = clocked(clock, one_k=UnsharedKNN(k=20, every_n_epochs=1),
                            four_k=UnsharedKNN(k=FOUR_K, every_n_epochs=1),
                            one_rate=OnlineLinearProbe(every_n_steps=1, max_samples=32),
                            four_rates=OnlineLinearProbe(heads=LinearHeads(lr=FOUR_RATES), every_n_steps=1, max_samples=32))
        seed_everything(0, verbose=False)
        tr = trainer(settings, root, callbacks, epochs + 1, 1, logger=False)
        tr.fit(quickstart_model(settings), datamodule=quickstart_data(settings))
    # the first epoch and evaluation warm up (allocator, lazily built heads)
    one_k, four_k = clock.per_call("one_k"), clock.per_call("four_k")
    one_rate, four_rates = (clock.per_epoch(name, None, epochs + 1) for name in ("one_rate", "four_rates"))
    knn = [b / a for a, b in zip(one_k[1:], four_k[1:])] or [four_k[0] / one_k[0]]
    probe = [b / a for a, b in zip(one_rate[1:], four_rates[1:])] or [four_rates[0] / one_rate[0]]
    return [
        ratio_row(section, f"kNN at k={FOUR_K} / at k=20 (one evaluation)", knn, "<= 1.2",
                  f"one feature pass, one top-{max(FOUR_K)}; k=20 takes "
                  f"{1e3 * sorted(one_k)[len(one_k) // 2]:.0f} ms"),
        ratio_row(section, "online probe with 4 rates / 1 rate (its training hook, every batch)", probe, "<= 1.5",
                  f"one forward of 32 images per batch, 4 heads; 1 rate takes "
                  f"{1e3 * sorted(one_rate)[len(one_rate) // 2]:.0f} ms/epoch"),
    ]
