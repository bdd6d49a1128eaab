"""The reproducible CPU mode: the same weights and the same numbers, to the last bit, on any x86-64
machine and whatever its core count, for one torch build.

A float32 run differs in the last bits between machines for three reasons, and each is fixed here
before torch loads (the ``shortcutlab`` command does it before its first import of torch):

- **ATen's kernel level.** ATen picks vectorised kernels for the best instruction set it finds
  (AVX-512 on one machine, AVX2 on another) and they round differently; ``ATEN_CPU_CAPABILITY=default``
  takes the baseline kernels every x86-64 runs.
- **MKL's code path.** The matrix products go through MKL, which dispatches on the processor too
  (and takes other paths on AMD than on Intel); ``MKL_CBWR=COMPATIBLE,STRICT`` is its conditional
  numerical reproducibility on the SSE2 branch that Intel documents for Intel and non-Intel
  processors alike, strict so that the alignment of a tensor does not matter either.
- **The thread count.** A product or a sum split over more threads is added in another order, so the
  count is fixed (:data:`THREADS`, whatever the machine has) and oneDNN, whose convolutions pick
  kernels by processor, is switched off (a convolution then runs as ATen's own im2col and MKL product).

It holds for one torch build on x86-64 CPUs. It cannot hold across torch releases, on other
architectures (aarch64 has neither MKL nor these kernel levels) or on GPUs, where the kernels are
the GPU's and cuDNN/cuBLAS choose them. It costs time: the baseline kernels and MKL's SSE2 branch are
slower (``python -m benchmarks --only reproducible`` measures the quickstart with and without).

A run asks for it with the CLI setting ``reproducible: true`` (the quickstart configs do), or with
``--reproducible=true``; ``--reproducible=false`` turns it off. ``SHORTCUTLAB_REPRODUCIBLE=1`` (or
``0``) in the environment decides for every run. From Python, call :func:`enable` before the first
``import torch`` and :func:`finish` after it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Sequence

THREADS = 2  # fixed whatever the machine has: the README's numbers were computed with 2
SWITCH = "SHORTCUTLAB_REPRODUCIBLE"  # "1": on for every run, "0": off for every run
THREADS_VARIABLE = "SHORTCUTLAB_REPRODUCIBLE_THREADS"  # another fixed count (numbers then differ from THREADS')
SETTING = "reproducible"


def threads() -> int:
    """The fixed thread count: :data:`THREADS`, or ``SHORTCUTLAB_REPRODUCIBLE_THREADS``."""
    value = os.environ.get(THREADS_VARIABLE, str(THREADS))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_VARIABLE} must be a whole number >= 1, got {value!r}")
    return int(value)


def environment() -> dict[str, str]:
    """The variables the mode sets before torch loads."""
    count = str(threads())
    return {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE,STRICT", "OMP_NUM_THREADS": count,
            "MKL_NUM_THREADS": count}


def _truth(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", "null", "none", ""):
        return False
    raise ValueError(f"{where}: reproducible must be true or false, got {value!r}")


def _from_config(path: str) -> Optional[bool]:
    """The top-level ``reproducible`` of a YAML config file, None when it has none or cannot be read
    (LightningCLI reports an unreadable config itself)."""
    try:
        import yaml

        loaded = yaml.safe_load(Path(path).read_text())
    except Exception:  # noqa: BLE001 (the CLI's own parse reports it, with file and line)
        return None
    if isinstance(loaded, dict) and SETTING in loaded and loaded[SETTING] is not None:
        return _truth(loaded[SETTING], path)
    return None


def requested(argv: Sequence[str]) -> bool:
    """Whether a training command line asks for the mode: ``SHORTCUTLAB_REPRODUCIBLE`` if set, else
    the last word of its ``--config`` files and ``--reproducible`` options, in the order given (as
    LightningCLI reads them: later ones win)."""
    if os.environ.get(SWITCH, "") != "":
        return _truth(os.environ[SWITCH], SWITCH)
    wanted, words = False, list(argv)
    for i, word in enumerate(words):
        name, has_value, value = word.partition("=")
        if name == "--config":
            path = value if has_value else (words[i + 1] if i + 1 < len(words) else None)
            found = _from_config(path) if path else None
            wanted = wanted if found is None else found
        elif name == f"--{SETTING}":
            if has_value:
                wanted = _truth(value, "--reproducible")
            elif i + 1 < len(words) and not words[i + 1].startswith("--"):
                wanted = _truth(words[i + 1], "--reproducible")
            else:
                wanted = True
    return wanted


def enable() -> None:
    """Set the mode's environment: call before the first ``import torch`` of the process (torch reads
    the kernel level, and MKL its code path, once). Refuses in one line when torch is already loaded
    without it."""
    if "torch" in sys.modules and not environment_in_force():
        raise RuntimeError("the reproducible CPU mode must be set before torch is imported: run through the "
                           "shortcutlab command, or call commands.reproducible_cpu.enable() first")
    os.environ.update(environment())


def environment_in_force() -> bool:
    """Whether this process started with the mode's environment (the variables torch and MKL read once)."""
    return all(os.environ.get(name) == value for name, value in environment().items() if name != "OMP_NUM_THREADS")


def finish() -> None:
    """After ``import torch``: the fixed thread count and oneDNN off (both read at each call)."""
    import torch

    torch.set_num_threads(threads())
    torch.backends.mkldnn.enabled = False


def in_force() -> bool:
    """Whether every part of the mode holds in this process now."""
    import torch

    return (environment_in_force() and torch.backends.cpu.get_cpu_capability() == "DEFAULT"
            and torch.get_num_threads() == threads() and not torch.backends.mkldnn.enabled)


def check(wanted: bool) -> None:
    """The CLI's check once the run's settings are parsed: a process started in the mode's
    environment completes the mode (threads, oneDNN), whatever the run asks; a run that asks for it
    (``reproducible: true``) in a process that loaded torch without it stops in one line."""
    import torch

    started_in_mode = environment_in_force() and torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    if wanted and not started_in_mode:
        raise ValueError("reproducible: true needs the reproducible CPU mode set before torch loads, and this "
                         "process loaded torch without it: run through the shortcutlab command, set "
                         f"{SWITCH}=1 before starting Python, or pass --reproducible=false")
    if started_in_mode:
        finish()
