"""Free memory where a tensor would live: a CUDA device's (``torch.cuda.mem_get_info``) or the
host's (``MemAvailable`` of ``/proc/meminfo``, shared by every process of the node)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

GIB = 2 ** 30


def free_bytes(device: torch.device) -> Optional[int]:
    """Bytes free on ``device`` now; None where it cannot be read (the host of another OS)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def size_text(nbytes: float) -> str:
    """``3.67 GiB``, ``12.0 MiB``, ``1.5 KiB``: the largest unit that leaves at least 1."""
    for unit, size in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            return f"{nbytes / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(nbytes)} B"
