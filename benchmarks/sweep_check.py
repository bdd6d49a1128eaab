"""How long a sweep's grid takes to check: ``shortcutlab sweep --print`` of a 100-point grid of the
quickstart config, in a fresh interpreter (start-up included, as a user waits for it), for two
shapes of grid: 10 values of ``alpha_min`` x 10 seeds, and 100 values of one key. Every distinct
value of every grid key is checked against its setting's type, on top of one full parse."""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

from .settings import Settings
from .startup import shortcutlab_command, wall_time
from .timing import Row, ratio_row

REPO = Path(__file__).resolve().parents[1]
GOAL_SECONDS = 10.0


def grids(points: int) -> dict[str, list[str]]:
    """``--grid`` arguments of each shape, ``points`` points each (a square number)."""
    side = int(points ** 0.5)
    alphas = [f"{0.5 + 0.5 * i / (points - 1):.4f}" for i in range(points)]
    return {f"{side} alpha_min x {side} seeds": ["--grid", "model.network.shortcut.alpha_min=" + ",".join(alphas[::side]),
                                                 "--grid", "seed_everything=" + ",".join(map(str, range(side)))],
            f"{points} alpha_min": ["--grid", "model.network.shortcut.alpha_min=" + ",".join(alphas)]}


def run(settings: Settings) -> list[Row]:
    section = "sweep grid check"
    points = settings.pick(100, 4)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as runs:
        for shape, grid in grids(points).items():
            command = [*shortcutlab_command(), "sweep", "--experiment", "bench", "--runs-dir", runs,
                       "--config", "configs/digits_mae.yaml", *grid, "--print"]
            times = [wall_time(command, env) for _ in range(min(settings.rounds, 3))]
            median = statistics.median(times)
            rows.append(ratio_row(section, f"`sweep --print`, {shape} (seconds, start-up included)", times,
                                  f"<= {GOAL_SECONDS:g}", f"{points / median:.1f} points checked a second; "
                                  f"{len(times)} rounds", unit="s"))
    return rows


if __name__ == "__main__":
    for row in run(Settings(rounds=3)):
        print(f"{row.name}: {row.median:.2f} s ({row.detail})", file=sys.stderr)
