"""``make gpu-check``: one command that proves the package on a CUDA machine.

On a machine with CUDA it runs, each as its own ``shortcutlab fit`` process:

1. every family's quick config (MAE, U-ViT diffusion, ResNet classifier, spiral) for
   ``--quick-steps`` steps in ``32-true`` and in ``bf16-mixed`` (``--jobs`` fits at a time, the
   DDP pair of item 3 among them: they check that each config runs, so their img/s is a
   throughput figure only at ``--jobs 1``);
2. the ImageNet-100 MAE ViT-B/16 and CIFAR-100 U-ViT-S paper configs, decayed and standard,
   ``--paper-steps`` steps each on generated data of the real shapes (real JPEG class folders,
   real CIFAR pickles), in bf16-mixed: images/s after the first steps, peak memory, and the
   decayed / standard images/s ratio;
3. a DDP run (``strategy=ddp``, NCCL, also on a single GPU) over every visible GPU of the quick
   MAE config, the same global batch as a one-GPU run without DDP: its final training loss must
   be within ``--ddp-tolerance`` of the one-GPU run's (the ranks draw their own masks and
   shuffles, so equal in distribution, not bit for bit);
4. ``python -m benchmarks --device cuda --precision bf16-mixed`` (plus ``--bench-args``), given
   what is left of ``--time-limit-s`` if one is set; the suite writes its table after each group,
   so a benchmark run cut off there keeps the groups it finished.

It writes ``runs/gpu-check/<gpu name>.md`` (``--update-docs``: ``docs/results/gpu/``, the results
the documentation cites; ``--out-dir``: elsewhere) and the benchmark table beside it after every
part, holding the parts asked for alone, so a run stopped part-way leaves the parts it finished
and marks the rest "not run"; it exits non-zero if any part asked for failed or did not run. Without CUDA it says so in one line and exits
0. Never part of CI.
"""
from __future__ import annotations

import argparse
import json
import pickle
import re
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_mods.checkpointing.atomic_files import write_atomically

from . import fit_breakdown
from .settings import Settings

REPO = Path(__file__).resolve().parents[1]
SCRATCH = REPO / "runs" / "gpu-check"  # a run's results unless asked to update the shipped ones
SHIPPED = REPO / "docs" / "results" / "gpu"
QUICK = {"MAE": ["--config=configs/digits_mae.yaml"],
         "diffusion": ["--config=configs/digits_diffusion_quick.yaml"],
         "classifier": ["--config=configs/data/digits.yaml", "--config=configs/digits_resnet/base.yaml",
                        "--config=configs/digits_resnet/decay.yaml"],
         "spiral": ["--config=configs/spiral_quick.yaml"]}
PAPER = {"ImageNet-100 MAE ViT-B/16": ("imagenet100_mae_vit_b16_alpha0.6", "imagenet100_mae_vit_b16_alpha1.0"),
         "CIFAR-100 U-ViT-S": ("cifar100_uvit_s_alpha0.6", "cifar100_uvit_s_alpha1.0")}
PEER = {"ImageNet-100 MAE ViT-B/16": "mae", "CIFAR-100 U-ViT-S": "uvit"}  # the official loop each is timed against
PRECISIONS = ("32-true", "bf16-mixed")
PARTS = ("quick", "ddp", "paper", "breakdown", "bench")
BREAKDOWN_EPOCH_STEPS = 100  # generated data of 100 steps an epoch at batch 128: the timed steps hold one epoch end
WARMUP_STEPS = 20  # steps before the clock starts (cuDNN autotuning, allocator growth)
NOT_RUN = {"status": None, "error": "not run"}


def fit(args: list[str], out: Path, steps: int, precision: str, devices: int = 1,
        extra: Optional[list[str]] = None, ddp: bool = False) -> dict:
    """One ``shortcutlab fit`` process (under ``strategy=ddp`` if ``ddp``); its Throughput record
    plus the exit status and seconds."""
    record_path = out / "throughput.json"
    result = fit_breakdown.fit(args, out, steps, precision, "gpu",
                               ["--trainer.callbacks+=benchmarks.fit_breakdown.Throughput",
                                f"--trainer.callbacks.path={record_path}", *(extra or []),
                                *(["--trainer.strategy=ddp"] if ddp else [])], devices=devices)
    if result["status"] == 0 and record_path.is_file():
        result.update(json.loads(record_path.read_text()))
    return result


def composition(name: str) -> list[str]:
    """The ``fit`` arguments of a configs/compositions.yaml row (its files, then its values)."""
    import yaml

    row = yaml.safe_load((REPO / "configs" / "compositions.yaml").read_text())[name]
    args = [a for a in row.get("args", []) if not a.startswith("--trainer.default_root_dir")]
    return [f"--config=configs/{c}" for c in row["configs"]] + args


def write_imagenet100(root: Path, per_class: int = 256) -> Path:
    """``root/{train,val}/<wnid>/*.JPEG`` for the 100 classes of configs/imagenet100_classes.txt,
    500 x 375 real JPEGs (the benchmarks' generator), one process per core. 256 a class: the 200
    steps at batch 128 stay inside one epoch, so the timed steps hold no epoch-end checkpoint of
    the 1.3 GB that ViT-B with AdamW writes (at 4 a class, one every 3 steps, the run took minutes)."""
    from .data_pipeline import write_jpeg_folder

    classes = (REPO / "configs" / "imagenet100_classes.txt").read_text().split()
    with ProcessPoolExecutor() as pool:
        list(pool.map(write_jpeg_folder, [str(root)] * len(classes), [per_class] * len(classes),
                      range(len(classes)), [[name] for name in classes]))
    return root


def write_cifar100(root: Path, n_train: int = 2048, n_test: int = 256) -> Path:
    """``root/cifar-100-python/{train, test, meta}`` pickles of random 32 x 32 images."""
    import numpy as np

    rng = np.random.default_rng(0)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("test", n_test)):
        fine = rng.integers(0, 100, size=n)
        rows = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        with open(folder / split, "wb") as f:
            pickle.dump({"batch_label": split, "fine_labels": fine.tolist(), "coarse_labels": (fine // 5).tolist(),
                         "data": rows, "filenames": [f"{split}_{i}.png" for i in range(n)]}, f, protocol=2)
    with open(folder / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"fine_{i}" for i in range(100)],
                     "coarse_label_names": [f"coarse_{i}" for i in range(20)]}, f, protocol=2)
    return root


def paper_data_args(row: str, data: dict[str, Path]) -> list[str]:
    if row.startswith("imagenet100"):  # the config's workers (from the host's cores)
        return [f"--data.init_args.data_dir={data['imagenet100']}"]
    return [f"--data.init_args.data_dir={data['cifar100']}", "--data.init_args.download=false",
            "--data.init_args.num_workers=4"]


def gpu_name() -> str:
    return torch.cuda.get_device_name(0)


def report(results: dict, out: Path, bench_file: Path, jobs: int) -> str:
    """The results file from what ``results`` holds so far: only the parts asked for (``--parts``),
    a figure not reached yet reads "not run", a failed one "FAIL"; the last line says which."""
    asked = results.get("parts", PARTS)
    lines = [f"# gpu-check on {gpu_name()}", "",
             f"`make gpu-check` at torch {torch.__version__}, CUDA {torch.version.cuda}, "
             f"{torch.cuda.device_count()} GPU(s); written by benchmarks/gpu_check.py with "
             f"`{results['command']}`; parts: {', '.join(asked)}."]
    if "quick" in asked:
        together = (f" Run {jobs} at a time (with the DDP pair) on one GPU: these rows check that each config "
                    "runs, and their img/s is shared, not a throughput figure." if jobs > 1 else "")
        lines += ["", "## Quick configs", "", f"{results['quick_steps']} steps each.{together}", "",
                  "| family | precision | status | steps | img/s | peak GiB | loss |", "|---|---|---|---|---|---|---|"]
        for family in QUICK:
            for precision in PRECISIONS:
                r = results["quick"].get(f"{family} {precision}", NOT_RUN)
                lines.append(f"| {family} | {precision} | {_status(r)} | {r.get('steps', '-')} | "
                             f"{_num(r.get('images_per_s'))} | {_num(r.get('peak_memory_gib'), 2)} | "
                             f"{_num(r.get('loss'), 4)} |")
    if "paper" in asked:
        lines += ["", "## Paper configs on generated data (bf16-mixed)", "",
                  f"{results['paper_steps']} steps each, one at a time; img/s from step {WARMUP_STEPS} on.", "",
                  "| config | run | status | img/s | peak GiB | decayed / standard img/s |", "|---|---|---|---|---|---|"]
        for name in PAPER:
            decayed, standard = results["paper"].get(name, (NOT_RUN, NOT_RUN))
            ratio = ((decayed.get("images_per_s") or 0) / standard["images_per_s"] if standard.get("images_per_s")
                     else None)
            for label, r in (("decayed", decayed), ("standard", standard)):
                lines.append(f"| {name} | {label} | {_status(r)} | {_num(r.get('images_per_s'))} | "
                             f"{_num(r.get('peak_memory_gib'), 2)} | {_num(ratio, 3) if label == 'decayed' else ''} |")
    if "breakdown" in asked:
        results.setdefault("breakdown", [])
        lines += ["", "## Where a fit's time goes (bf16-mixed)", "",
                  f"`benchmarks/fit_breakdown.py` on each paper config (decayed), data generated at "
                  f"{BREAKDOWN_EPOCH_STEPS} steps an epoch; fits with validation off, the clock started after "
                  f"step {WARMUP_STEPS}. A callback's share is the time inside its hooks (synchronised) per step, "
                  f"against the step alone; its epoch-end part (the checkpoint) counts once per "
                  f"{BREAKDOWN_EPOCH_STEPS} steps here, against once per ~990 steps on the real ImageNet-100 "
                  f"and ~390 on CIFAR-100 at batch 128.",
                  *fit_breakdown.markdown(results["breakdown"])]
        if not results["breakdown"]:
            lines.append("\nnot run")
        elif any(row.median is None for row in results["breakdown"]):
            lines.append("\nFAIL: a breakdown figure was not measured (its row says why)")
    if "ddp" in asked:
        lines += ["", "## DDP", "", results.get("ddp", {"summary": "not run"})["summary"]]
    if "bench" in asked:
        bench = results.get("bench", {"status": None, "summary": "not run"})
        lines += ["", "## Benchmarks", "",
                  f"`{bench.get('command', 'python -m benchmarks --device cuda --precision bf16-mixed')}`: "
                  f"{bench['summary']}" + (f"; table in [{bench_file.name}]({bench_file.name})."
                                           if bench_file.is_file() else ".")]
    failed = any("FAIL" in line for line in lines)
    unfinished = any("not run" in line for line in lines)
    lines += ["", "## Result", "", "FAILED: see the rows marked FAIL above" if failed else
              "not finished: the figures marked \"not run\" were not reached" if unfinished else
              f"every part asked for passed ({', '.join(asked)})", ""]
    text = "\n".join(lines)
    write_atomically(out, lambda f: f.write(text.encode()))
    return text


def _status(r: dict) -> str:
    if r.get("status") == 0:
        return "ok"
    if r is NOT_RUN:
        return "not run"
    return f"FAIL ({r.get('error', r.get('status'))})"


def _progress(r: dict) -> str:
    """A fit's status with its figures, printed as each fit ends: a run cut short keeps them."""
    return (f"{_status(r)}, {_num(r.get('images_per_s'))} img/s, {_num(r.get('peak_memory_gib'), 2)} GiB peak, "
            f"loss {_num(r.get('loss'), 4)}")


def _num(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="make gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--quick-steps", type=int, default=300)
    parser.add_argument("--paper-steps", type=int, default=200)
    parser.add_argument("--ddp-steps", type=int, default=200)
    parser.add_argument("--breakdown-compile", action="store_true",
                        help="the breakdown also times the step with the residual blocks compiled, the step with the "
                             "network captured (CompileNetwork) and a fit with it")
    parser.add_argument("--breakdown-steps", type=int, default=BREAKDOWN_EPOCH_STEPS,
                        help="timed steps of each breakdown figure (after the warm-up)")
    parser.add_argument("--ddp-tolerance", type=float, default=0.05, help="relative, on the final training loss")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the results go (default runs/gpu-check/; --update-docs: docs/results/gpu/, "
                             "the results the documentation cites)")
    parser.add_argument("--update-docs", action="store_true",
                        help="write into docs/results/gpu/, replacing the shipped results of this GPU")
    parser.add_argument("--jobs", type=int, default=1,
                        help="quick-config fits run at a time (their img/s is a figure only at 1); paper configs "
                             "and the benchmarks always run alone")
    parser.add_argument("--bench-args", default="", help="more arguments for python -m benchmarks, e.g. '--rounds 2'")
    parser.add_argument("--time-limit-s", type=float, default=None,
                        help="seconds for the whole check, less 30 s to write the results: the breakdown starts "
                             "no figure past it and stops a fit running then (the table says which), the benchmark "
                             "part gets what is left")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="the parts to run (a subset writes <gpu name>-<parts>.md, so split runs keep both files)")
    args = parser.parse_args(argv)
    if args.out_dir is not None and args.update_docs:
        parser.error("--out-dir and --update-docs name two places; give one")
    if args.out_dir is None:
        args.out_dir = SHIPPED if args.update_docs else SCRATCH
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    start = time.perf_counter()
    args = parse(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing run", file=sys.stderr)
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name()).strip("-")
    if list(args.parts) != list(PARTS):
        stem += "-" + "-".join(part for part in PARTS if part in args.parts)
    out, bench_file = args.out_dir / f"{stem}.md", args.out_dir / f"{stem}-benchmarks.md"
    given = sys.argv[1:] if argv is None else argv
    results: dict = {"command": "make gpu-check" + (f" ARGS={shlex.quote(shlex.join(given))}" if given else ""),
                     "quick_steps": args.quick_steps, "paper_steps": args.paper_steps, "quick": {}, "paper": {},
                     "parts": list(args.parts)}
    written = lambda: report(results, out, bench_file, args.jobs)  # noqa: E731 (after every part)
    written()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        if "quick" in args.parts or "ddp" in args.parts:
            quick_and_ddp(args, scratch, results)
            written()
        if "paper" in args.parts:
            data = {"imagenet100": write_imagenet100(scratch / "imagenet100"),
                    "cifar100": write_cifar100(scratch / "cifar100")}
            for name, rows in PAPER.items():
                results["paper"][name] = [fit(composition(row) + paper_data_args(row, data), scratch / row,
                                              args.paper_steps, "bf16-mixed") for row in rows]
                print(f"gpu-check: {name}: {[_progress(r) for r in results['paper'][name]]}", file=sys.stderr)
                written()
        if "breakdown" in args.parts:
            per_class = BREAKDOWN_EPOCH_STEPS * 128 // 100
            data = {"imagenet100": write_imagenet100(scratch / "imagenet100-breakdown", per_class=per_class),
                    "cifar100": write_cifar100(scratch / "cifar100-breakdown", n_train=BREAKDOWN_EPOCH_STEPS * 128)}
            cases = [fit_breakdown.Case(name, composition(rows[0]) + paper_data_args(rows[0], data), WARMUP_STEPS,
                                        args.breakdown_steps, "generated data of the real shapes", peer=PEER[name])
                     for name, rows in PAPER.items()]
            imagenet = cases[0]  # its training images decoded and augmented on the GPU: the loader and the fit
            cases.insert(1, fit_breakdown.Case(f"{imagenet.name}, data.decoder=gpu",
                                               imagenet.fit_args + ["--data.init_args.decoder=gpu"], WARMUP_STEPS,
                                               args.breakdown_steps, imagenet.note, fits=("none", "shipped"),
                                               peer=None))

            def keep(rows_so_far: list) -> None:
                results["breakdown"] = rows_so_far
                written()
            deadline = None if args.time_limit_s is None else \
                time.monotonic() + args.time_limit_s - (time.perf_counter() - start) - 30
            fit_breakdown.run_cases(cases, Settings(device="cuda", precision="bf16-mixed",
                                                    compile=args.breakdown_compile), after_case=keep, deadline=deadline)
            written()
    if "bench" in args.parts:
        results["bench"] = benchmarks(args, bench_file, None if args.time_limit_s is None
                                      else args.time_limit_s - (time.perf_counter() - start) - 30)
    text = written()
    print(text)
    return 0 if "every part asked for passed" in text else 1


def quick_and_ddp(args: argparse.Namespace, scratch: Path, results: dict) -> None:
    """The quick configs and the DDP pair, ``--jobs`` at a time (none of them is a timing)."""
    gpus = torch.cuda.device_count()
    per_device = max(1, 128 // gpus)  # the quickstart's batch of 128, split over the GPUs
    runs = {}
    if "quick" in args.parts:
        runs = {f"{family} {precision}": (config, scratch / f"{family}-{precision}", args.quick_steps, precision)
                for family, config in QUICK.items() for precision in PRECISIONS}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        if "ddp" in args.parts:
            ddp_run = pool.submit(fit, QUICK["MAE"], scratch / "ddp-n", args.ddp_steps, "32-true", devices=gpus,
                                  extra=[f"--data.init_args.batch_size={per_device}"], ddp=True)
            runs["ddp-1"] = (QUICK["MAE"], scratch / "ddp-1", args.ddp_steps, "32-true")
        pending = {name: pool.submit(fit, *run) for name, run in runs.items()}
        for name, future in pending.items():
            if name != "ddp-1":
                results["quick"][name] = future.result()
                print(f"gpu-check: {name}: {_progress(results['quick'][name])}", file=sys.stderr)
        if "ddp" not in args.parts:
            return
        one, many = pending["ddp-1"].result(), ddp_run.result()
    ok = one.get("status") == 0 and many.get("status") == 0 and one.get("loss") and many.get("loss") is not None \
        and abs(many["loss"] - one["loss"]) <= args.ddp_tolerance * abs(one["loss"])
    results["ddp"] = {"ok": bool(ok), "summary": (
        f"{'ok' if ok else 'FAIL'}: {gpus} GPU(s) under DDP (NCCL, batch {per_device} per GPU) final training "
        f"loss {_num(many.get('loss'), 4)} against {_num(one.get('loss'), 4)} on one GPU without DDP (batch "
        f"128), tolerance {args.ddp_tolerance:.0%} relative; {_status(many)} / {_status(one)}")}
    print(f"gpu-check: {results['ddp']['summary']}", file=sys.stderr)


def benchmarks(args: argparse.Namespace, bench_file: Path, seconds: Optional[float]) -> dict:
    """``python -m benchmarks`` on CUDA in bf16-mixed, stopped after ``seconds`` if given."""
    command = [sys.executable, "-m", "benchmarks", "--device", "cuda", "--precision", "bf16-mixed",
               *shlex.split(args.bench_args), "--out", str(bench_file)]
    shown = "python " + shlex.join(command[1:-2])
    if seconds is not None and seconds < 60:
        return {"status": None, "command": shown, "summary": f"not run ({seconds:.0f} s of the time limit left)"}
    try:
        status = subprocess.run(command, cwd=REPO, timeout=seconds).returncode
    except subprocess.TimeoutExpired:
        return {"status": None, "command": shown,
                "summary": f"FAIL: stopped at the time limit after {seconds:.0f} s, the table holds the groups it finished"}
    return {"status": status, "command": shown, "summary": "ok" if status == 0 else f"FAIL (exit status {status})"}


if __name__ == "__main__":
    sys.exit(main())
