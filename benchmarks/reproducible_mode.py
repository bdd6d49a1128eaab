"""What the reproducible CPU mode costs: the quickstart (``configs/digits_mae.yaml``, its callbacks
as shipped, an evaluation at the end) in a fresh interpreter with ``--reproducible=true`` against
``--reproducible=false``, interleaved on the same machine. The full quickstart takes minutes a
run, so the row times a shorter budget of the same config (``EPOCHS``)."""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path

from .settings import Settings
from .startup import shortcutlab_command, wall_time
from .timing import Row, ratio_row, skipped

REPO = Path(__file__).resolve().parents[1]
EPOCHS = 10  # of the quickstart's 100, with its evaluation (kNN, probe, rank at every block) at the last


def run(settings: Settings) -> list[Row]:
    section = "reproducible CPU mode"
    name = f"quickstart, {EPOCHS} epochs: `--reproducible=true` / `--reproducible=false` (wall time)"
    if settings.on_cuda:
        return [skipped(section, name, "the mode is about the CPU's kernels")]
    env = {k: v for k, v in os.environ.items() if k not in ("SHORTCUTLAB_REPRODUCIBLE", "ATEN_CPU_CAPABILITY",
                                                              "MKL_CBWR", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    root = Path(tempfile.mkdtemp(prefix="bench-reproducible-"))
    epochs = settings.pick(EPOCHS, 1)
    smaller = settings.pick([], ["--trainer.limit_train_batches=2", "--model.network.depth=2",
                                 "--model.network.decoder_depth=1"])  # quick: the command runs, nothing more
    commands = {mode: [*shortcutlab_command(), "fit", "--config", "configs/digits_mae.yaml", f"--reproducible={mode}",
                       f"--trainer.max_epochs={epochs}", "--trainer.enable_progress_bar=false",
                       f"--trainer.default_root_dir={root / mode}", *smaller]
                for mode in ("true", "false")}
    times: dict[str, list[float]] = {mode: [] for mode in commands}
    try:
        for round_ in range(min(settings.rounds, 3)):  # minutes a round
            for mode in (("true", "false") if round_ % 2 == 0 else ("false", "true")):
                shutil.rmtree(root / mode, ignore_errors=True)
                times[mode].append(wall_time(commands[mode], env))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return [ratio_row(section, name, [a / b for a, b in zip(times["true"], times["false"])],
                      detail=f"on {statistics.median(times['true']):.1f} s, off {statistics.median(times['false']):.1f} s; "
                             f"{len(times['true'])} rounds, {epochs} epochs")]
