"""What measuring at several settings in one pass costs: ``KNNEvaluator(k=[10, 20, 100,
200])`` against ``KNNEvaluator(k=20)``, and ``OnlineLinearProbe`` with four rates against one, on
the quickstart's MAE and digits. Both variants run in the same fit (two callbacks of one class
in one Trainer), each timed around its own hook, so every round pairs them on the same weights.
"""
from __future__ import annotations

import tempfile
import time
from typing import Any

from lightning.pytorch import seed_everything

from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.shared_features import SharedEvaluation
from callbacks.measurement.online_probe import OnlineLinearProbe

from .settings import Settings
from .timing import Row, ratio_row, synchronize
from .quickstart_training import quickstart_data, quickstart_model, quiet, trainer

FOUR_K = [10, 20, 100, 200]  # DINO's
FOUR_RATES = [1e-3, 3e-3, 1e-2, 3e-2]


class TimedKNN(KNNEvaluator):
    """A KNNEvaluator that records the seconds of each of its evaluations."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds: list[float] = []

    def evaluate(self, trainer, pl_module):  # noqa: ANN001, ANN201
        synchronize(pl_module.device)
        start = time.perf_counter()
        with SharedEvaluation.of(trainer).unshared():  # its own feature passes, as if it were alone
            result = super().evaluate(trainer, pl_module)
        synchronize(pl_module.device)
        self.seconds.append(time.perf_counter() - start)
        return result


class TimedProbe(OnlineLinearProbe):
    """An OnlineLinearProbe that records the seconds of its training hook, per epoch."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds: list[float] = []
        self._epoch_seconds = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        synchronize(pl_module.device)
        start = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        synchronize(pl_module.device)
        self._epoch_seconds += time.perf_counter() - start

    def on_train_epoch_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.seconds.append(self._epoch_seconds)
        self._epoch_seconds = 0.0


def run(settings: Settings) -> list[Row]:
    section = "several settings in one pass"
    epochs = settings.pick(max(3, settings.rounds), 1)
    with quiet(), tempfile.TemporaryDirectory() as root:
        one_k, four_k = TimedKNN(k=20, every_n_epochs=1), TimedKNN(k=FOUR_K, every_n_epochs=1)
        one_rate = TimedProbe(every_n_steps=1, max_samples=32)
        four_rates = TimedProbe(lr=FOUR_RATES, every_n_steps=1, max_samples=32)
        seed_everything(0, verbose=False)
        tr = trainer(settings, root, [one_k, four_k, one_rate, four_rates], epochs + 1, 1, logger=False)
        tr.fit(quickstart_model(settings), datamodule=quickstart_data(settings))
    # the first epoch and evaluation warm up (allocator, lazily built heads)
    knn = [b / a for a, b in zip(one_k.seconds[1:], four_k.seconds[1:])] or [four_k.seconds[0] / one_k.seconds[0]]
    probe = [b / a for a, b in zip(one_rate.seconds[1:], four_rates.seconds[1:])] or \
        [four_rates.seconds[0] / one_rate.seconds[0]]
    return [
        ratio_row(section, f"kNN at k={FOUR_K} / at k=20 (one evaluation)", knn, "<= 1.2",
                  f"one feature pass, one top-{max(FOUR_K)}; k=20 takes "
                  f"{1e3 * sorted(one_k.seconds)[len(one_k.seconds) // 2]:.0f} ms"),
        ratio_row(section, "online probe with 4 rates / 1 rate (its training hook, every batch)", probe, "<= 1.5",
                  f"one forward of 32 images per batch, 4 heads; 1 rate takes "
                  f"{1e3 * sorted(one_rate.seconds)[len(one_rate.seconds) // 2]:.0f} ms/epoch"),
    ]
