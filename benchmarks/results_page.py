"""The results as a Markdown table (linked from the README) and as JSON."""
from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from lightning_mods.checkpointing.atomic_files import write_atomically

from .settings import Settings
from .timing import Row


def environment(settings: Settings, seconds: float) -> dict:
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.processor()
            or platform.machine(), "threads": torch.get_num_threads(), "device": settings.device,
            "gpu": torch.cuda.get_device_name() if settings.on_cuda else None, "precision": settings.precision,
            "rounds": settings.rounds, "quick": settings.quick, "seconds": round(seconds, 1)}


def _value(row: Row, value: float | None) -> str:
    if value is None:
        return "-"
    if row.unit == "share":
        return f"{100 * value:.1f} %"
    if row.unit in ("img/s", "workers", "points", "s"):
        return f"{value:.1f} {row.unit}"
    return f"{value:.3f}"


def _goal(row: Row) -> str:
    if row.goal is None:
        return "-"
    op, bound = row.goal.split()
    bound_text = f"{100 * float(bound):.0f} %" if row.unit == "share" else \
        (f"{bound} {row.unit}" if row.unit in ("img/s", "workers", "points", "s") else bound)
    return f"{op.replace('<=', '≤').replace('>=', '≥')} {bound_text}"


def markdown(rows: list[Row], env: dict, command: str) -> str:
    lines = ["# shortcutlab benchmark results", "",
             f"`{command}` — torch {env['torch']}, {env['threads']} threads, device {env['device']}"
             + (f" ({env['gpu']})" if env["gpu"] else "") + f", precision {env['precision']}, "
             f"{env['rounds']} interleaved rounds, {env['seconds']:.0f} s in all.", "",
             "Every figure is a ratio of variants timed in the same process, interleaved A B A B; "
             "median and min over the rounds. PASS/MISS compares the median with the goal.", ""]
    section = None
    for row in rows:
        if row.section != section:
            section = row.section
            lines += ["", f"## {section}", "", "| figure | median | min | goal | status | detail |",
                      "|---|---|---|---|---|---|"]
        lines.append(f"| {row.name} | {_value(row, row.median)} | {_value(row, row.minimum)} | {_goal(row)} | "
                     f"{row.status} | {row.detail} |")
    return "\n".join(lines) + "\n"


def write(rows: list[Row], env: dict, command: str, markdown_path: Path, json_path: Path) -> None:
    """Both files whole or not at all (a run stopped while writing leaves the previous ones)."""
    text = markdown(rows, env, command)
    data = json.dumps({"command": command, "environment": env, "rows": [row.as_dict() for row in rows]}, indent=1)
    write_atomically(markdown_path, lambda f: f.write(text.encode()))
    write_atomically(json_path, lambda f: f.write((data + "\n").encode()))
