"""Side-by-side timing: every figure of the suite is a ratio of two (or more) variants run in
the same process, interleaved ``A B A B ...`` over several rounds, so that a machine whose speed
drifts (other jobs, thermal limits) slows both sides of a ratio alike.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels (CUDA is asynchronous; the CPU is not)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def rotated(names: list[str], round_: int) -> list[str]:
    """``names`` started ``round_`` places on (A B C, B C A, C A B, ...)."""
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def interleaved(variants: dict[str, Callable[[], object]], rounds: int, calls: int = 1, warmup: int = 1,
                device: torch.device | str = "cpu") -> dict[str, list[float]]:
    """Seconds per call of each variant, one entry per round.

    Every variant is called ``warmup`` times first (allocator, caches, lazy inits), then in each
    round every variant in turn runs ``calls`` times back to back and its mean is recorded. The
    order rotates from round to round (A B C, B C A, C A B, ...), so that no variant always runs
    first, or always after the same other one.
    """
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(rounds):
        for name in rotated(list(variants), round_):
            fn = variants[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            synchronize(device)
            times[name].append((time.perf_counter() - start) / calls)
    return times


def interleaved_fresh(make_variants: Callable[[], dict[str, Callable[[], object]]], rounds: int, warmup: int = 1,
                      device: torch.device | str = "cpu", budget_s: float = 0.0,
                      max_rounds: int = 0) -> dict[str, list[float]]:
    """Seconds of one call of each variant per round, as :func:`interleaved` (order rotating),
    but with the variants built anew by ``make_variants`` every round and warmed up ``warmup``
    times: a model keeps the memory it was given for its life, and on this machine two copies of
    the same network have run 3-4 % apart for as long as they lived, so a figure over one set
    of copies measures their memory placement as much as the code. Over fresh copies the
    placement averages out in the median. After ``rounds`` rounds it goes on while less than
    ``budget_s`` seconds have passed, up to ``max_rounds``: short steps get more rounds."""
    times: dict[str, list[float]] = {}
    start_all = time.perf_counter()
    round_ = 0
    while round_ < rounds or (time.perf_counter() - start_all < budget_s and round_ < max_rounds):
        variants = make_variants()
        for fn in variants.values():
            for _ in range(warmup):
                fn()
        synchronize(device)
        for name in rotated(list(variants), round_):
            start = time.perf_counter()
            variants[name]()
            synchronize(device)
            times.setdefault(name, []).append(time.perf_counter() - start)
        round_ += 1
    return times


def paired_ratios(times: dict[str, list[float]], numerator: str, denominator: str) -> list[float]:
    """Per-round ratios ``numerator / denominator`` (pairs taken in the same round)."""
    return [a / b for a, b in zip(times[numerator], times[denominator])]


@dataclass
class Row:
    """One line of the results table.

    ``goal`` is ``"<= 1.02"``-style text (``None``: measured for information only); the status
    compares the MEDIAN with it. ``value`` is what the row reports (a ratio, a share or a time).
    """

    section: str
    name: str
    median: Optional[float]
    minimum: Optional[float] = None
    goal: Optional[str] = None
    unit: str = "x"
    detail: str = ""
    raw: dict = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.median is None:
            return "SKIP"
        if self.goal is None:
            return "info"
        op, bound = self.goal.split()
        ok = self.median <= float(bound) if op == "<=" else self.median >= float(bound)
        return "PASS" if ok else "MISS"

    def as_dict(self) -> dict:
        return {**asdict(self), "status": self.status}


def ratio_row(section: str, name: str, ratios: list[float], goal: Optional[str] = None, detail: str = "",
              unit: str = "x", raw: Optional[dict] = None) -> Row:
    """A row from per-round values: median and min over the rounds."""
    return Row(section, name, statistics.median(ratios), min(ratios), goal, unit, detail, raw or {})


def skipped(section: str, name: str, why: str) -> Row:
    return Row(section, name, None, None, None, "", f"skipped: {why}")
