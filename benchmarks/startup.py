"""Start-up figures, each a fresh interpreter: ``shortcutlab --help`` and the time to the end of
the first training step of the quickstart, both against ``python -c "import torch"``."""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .settings import Settings
from .timing import Row, ratio_row

REPO = Path(__file__).resolve().parents[1]


def shortcutlab_command() -> list[str]:
    """The installed console script next to this interpreter, else ``python cli.py``."""
    script = Path(sys.executable).with_name("shortcutlab")
    return [str(script)] if script.exists() else [sys.executable, str(REPO / "cli.py")]


def wall_time(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def startup(settings: Settings) -> list[Row]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    root = tempfile.mkdtemp(prefix="bench-startup-")
    first_step = [*shortcutlab_command(), "fit", "--config", "configs/digits_mae.yaml", "--trainer.max_steps=1",
                  "--trainer.callbacks=[]", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
                  "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
                  f"--trainer.accelerator={settings.torch_device.type}", f"--trainer.default_root_dir={root}"]
    commands = {"import torch": [sys.executable, "-c", "import torch"],
                "--help": [*shortcutlab_command(), "--help"],
                "first step": first_step}
    times: dict[str, list[float]] = {name: [] for name in commands}
    try:
        if not settings.quick:
            for cmd in commands.values():  # warm the file cache once
                wall_time(cmd, env)
        for _ in range(min(settings.rounds, 3)):  # at most 3: a fresh interpreter per call is slow
            for name, cmd in commands.items():
                times[name].append(wall_time(cmd, env))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    torch_s = statistics.median(times["import torch"])
    section = "start-up (fresh interpreter)"
    return [
        ratio_row(section, "`shortcutlab --help` / `python -c \"import torch\"`",
                  [a / b for a, b in zip(times["--help"], times["import torch"])], "<= 2.0",
                  f"--help {statistics.median(times['--help']):.1f} s, import torch {torch_s:.1f} s; "
                  f"{len(times['--help'])} rounds"),
        ratio_row(section, "quickstart `fit` to the end of step 1 / `import torch`",
                  [a / b for a, b in zip(times["first step"], times["import torch"])],
                  detail=f"{statistics.median(times['first step']):.1f} s (parse, build, data, one step)"),
    ]


def run(settings: Settings) -> list[Row]:
    return startup(settings)
