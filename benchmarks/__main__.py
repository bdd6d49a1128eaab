"""``python -m benchmarks``: run the suite, print the table, write Markdown and JSON."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from . import (data_pipeline, depth_evaluation_cost, fit_breakdown, knn_at_scale, models, object_storage, op_counts,
               probe_accuracy, quickstart_training, reproducible_mode, results_page, several_settings, startup,
               sweep_check)
from .settings import Settings
from .timing import skipped

RESULTS = Path(__file__).with_name("results.md")  # the full suite's table (README, Performance)
GROUPS = {"models": models.run, "training": quickstart_training.run, "several": several_settings.run,
          "depth": depth_evaluation_cost.run, "startup": startup.run, "data": data_pipeline.run,
          "probe-accuracy": probe_accuracy.run, "breakdown": fit_breakdown.run, "ops": op_counts.run,
          "knn": knn_at_scale.run, "reproducible": reproducible_mode.run,
          "sweep": sweep_check.run, "storage": object_storage.run}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke test)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per figure (default 5, quick 1)")
    parser.add_argument("--only", nargs="+", choices=tuple(GROUPS), default=list(GROUPS), help="groups to run")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (torch.set_num_threads and OMP_NUM_THREADS of the start-up subprocesses); "
                             "1 on a machine shared with other jobs, where OpenMP's spinning threads can slow a "
                             "2-thread run by 10x")
    parser.add_argument("--compile", action="store_true", help="also time nn.Module.compile (slow cold start)")
    parser.add_argument("--out", type=Path, default=None,
                        help="Markdown file; the JSON goes next to it with a .json suffix (default: "
                             "benchmarks/results.md for the whole suite, benchmarks/results-<groups>.md for "
                             "some groups, so that a partial run never replaces the whole suite's table)")
    args = parser.parse_args(argv)
    if args.out is None:
        chosen = list(dict.fromkeys(args.only))
        args.out = RESULTS if set(chosen) == set(GROUPS) else RESULTS.with_name(f"results-{'-'.join(chosen)}.md")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def run_groups(groups: list[str], settings: Settings,
               after_group: Callable[[list, float], None] = lambda rows, seconds: None) -> tuple[list, float]:
    """Rows of the chosen groups, in order, and the seconds they took; ``after_group(rows, seconds)``
    after each group (the report is written there, so a run stopped part-way keeps what it measured)."""
    torch.manual_seed(0)
    start = time.perf_counter()
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in groups:
            group_start = time.perf_counter()
            rows += GROUPS[name](settings)
            print(f"[{name}: {time.perf_counter() - group_start:.0f} s]", file=sys.stderr)
            after_group(rows, time.perf_counter() - start)
    return rows, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    command = "python -m benchmarks " + shlex.join(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks: --device cuda but no CUDA device is available; nothing measured", file=sys.stderr)
        rows = [skipped("CUDA", "every figure", "no CUDA device")]
        settings = Settings(device="cpu", precision=args.precision, quick=args.quick, rounds=0)
        results_page.write(rows, results_page.environment(settings, 0.0), command, args.out, args.out.with_suffix(".json"))
        return 0
    settings = Settings(device=args.device, precision=args.precision, quick=args.quick,
                        rounds=args.rounds or (1 if args.quick else 5), compile=args.compile)
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    def write(rows: list, seconds: float) -> None:
        env = results_page.environment(settings, seconds)
        env["threads"] = args.threads or threads
        results_page.write(rows, env, command, args.out, args.out.with_suffix(".json"))

    try:
        rows, seconds = run_groups(args.only, settings, after_group=write)
    finally:  # the caller's (e.g. the test session's) threads as they were
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    env = results_page.environment(settings, seconds)
    env["threads"] = args.threads or threads
    print(results_page.markdown(rows, env, command))
    print(f"written: {args.out} and {args.out.with_suffix('.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
