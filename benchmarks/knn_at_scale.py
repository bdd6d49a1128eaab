"""What the kNN bank costs at scale: scoring speed against the arithmetic's limit, and each
rank's memory as ranks are added.

- **Speed.** The package's scoring (:func:`~callbacks.measurement.knn_scoring.local_neighbours`
  and the vote's correct counts) of a 200,000 x 768 bank against 10,000 queries, k = 20, against
  a plain loop of ``(queries @ bank.T).topk(20)`` over the same query chunks of the same
  tensors: the matmul and top-k are the limit; the rest should cost little.
- **Memory.** A synthetic bank of 20,000 images x 768 features in 13 banks (the features and 12
  blocks, float32: 762 MiB) embedded and scored by ``KNNEvaluator(blocks="all")`` in a real
  ``Trainer.validate`` at 1, 2 and 4 processes (gloo, torchrun): each rank's peak resident memory
  over the evaluation (``VmHWM``, reset at its start). Goal: at W processes each rank holds at
  most 1.1 / W of one process's bank (its 13 float32 banks, 762 MiB) plus the work memory one
  process needed beside its bank (the gathered queries, the scoring chunk, a batch of features).
"""
from __future__ import annotations

import json
import os
import statistics
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from callbacks.measurement.knn_scoring import correct_counts, local_neighbours, query_rows

from .settings import Settings
from .timing import Row, interleaved, paired_ratios, ratio_row, skipped

ROOT = Path(__file__).resolve().parents[1]
SCORING_MIB = 256


def synthetic_bank(bank_rows: int, queries_count: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Unit-length random ``bank_rows x 768`` bank rows and queries with labels of 1000 classes (seed 0)."""
    g = torch.Generator().manual_seed(0)
    bank = F.normalize(torch.randn(bank_rows, 768, generator=g), dim=1).to(device)
    labels = torch.randint(0, 1000, (bank_rows,), generator=g).to(device)
    queries = F.normalize(torch.randn(queries_count, 768, generator=g), dim=1).to(device)
    return bank, labels, queries, torch.randint(0, 1000, (queries_count,), generator=g).to(device)


def scoring_rows(settings: Settings) -> list[Row]:
    section = "kNN bank at scale"
    bank_rows, queries_count = settings.pick((200_000, 10_000), (5_000, 200))
    device = settings.torch_device
    bank, labels, queries, query_labels = synthetic_bank(bank_rows, queries_count, device)
    budget = SCORING_MIB * 2 ** 20
    rows = query_rows(budget, bank_rows)

    def plain() -> None:
        for start in range(0, queries_count, rows):
            (queries[start:start + rows] @ bank.T).topk(20, dim=1)

    def package() -> None:
        sims, found, _ = local_neighbours(bank, labels, queries, 20, budget)
        correct_counts(sims, found, query_labels, 1000, [20], 0.07, (1, 5), budget)

    times = interleaved({"plain": plain, "package": package}, rounds=settings.pick(3, 1), warmup=0, device=device)
    return [ratio_row(section, f"kNN scoring, {bank_rows:,} x 768 bank, {queries_count:,} queries, k=20: package / "
                               "plain chunked matmul + topk", paired_ratios(times, "package", "plain"), "<= 1.15",
                      f"{rows} queries a chunk ({SCORING_MIB} MiB); plain takes {min(times['plain']):.1f} s")]


def clustered(count: int, centres: torch.Tensor, spread: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.arange(count) % len(centres)
    return centres[labels] + spread * torch.randn(count, centres.shape[1], generator=g), labels


def dtype_rows(settings: Settings) -> list[Row]:
    """kNN top-1 of a synthetic bank (100 overlapping classes in 768 dimensions) stored in each
    dtype, as the evaluator stores it (unit-length rows), minus float32's: what the storage costs."""
    section = "kNN bank at scale"
    bank_rows, queries_count = settings.pick((50_000, 2_000), (2_000, 200))
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(100, 768, generator=g)
    bank, labels = clustered(bank_rows, centres, 5.0, g)
    queries, query_labels = clustered(queries_count, centres, 5.0, g)
    normalized = F.normalize(queries, dim=1)
    top1, neighbours = {}, {}
    for name in ("float32", "float16", "bfloat16"):
        stored = F.normalize(bank, dim=1).to(getattr(torch, name))
        sims, found, neighbours[name] = local_neighbours(stored, labels, normalized, 20)
        top1[name] = int(correct_counts(sims, found, query_labels, 100, [20], 0.07, (1,))[0]) / queries_count

    def changed(name: str) -> float:
        same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(neighbours[name], neighbours["float32"]))
        return 100 * (1 - same / neighbours[name].numel())

    return [Row(section, f"kNN top-1, {name} bank - float32 bank (synthetic, {bank_rows:,} x 768, {queries_count:,} "
                         "queries, 100 classes)", 100 * (top1[name] - top1["float32"]), unit="points",
                detail=f"float32: {100 * top1['float32']:.2f} %, {name}: {100 * top1[name]:.2f} %; "
                       f"{changed(name):.2f} % of the 20 neighbours differ")
            for name in ("float16", "bfloat16")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_per_rank(processes: int, images: int, out: Path) -> list[dict]:
    """What each rank of a ``processes``-process run of :mod:`benchmarks.knn_memory_worker` measured."""
    folder = out / f"w{processes}"
    folder.mkdir(parents=True, exist_ok=True)
    # glibc's mmap threshold fixed at 128 KiB: freed tensors leave the resident set at once (its dynamic
    # threshold keeps up to 64 MiB of freed memory resident, more or less by the run)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MALLOC_MMAP_THRESHOLD_="131072",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(processes),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "benchmarks.knn_memory_worker",
           str(folder), str(images), str(SCORING_MIB // 16)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"knn memory run at {processes} processes failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(processes)]


def memory_rows(settings: Settings) -> list[Row]:
    section = "kNN bank at scale"
    if not Path("/proc/self/clear_refs").exists():
        return [skipped(section, "kNN bank memory per rank", "needs Linux's /proc/self/clear_refs")]
    images, rounds = settings.pick(20_000, 2_000), settings.pick(3, 1)
    ratios: dict[int, list[float]] = {2: [], 4: []}
    grown: dict[int, list[float]] = {1: [], 2: [], 4: []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(rounds):  # resident sizes move by tens of MiB from run to run: a median of runs
            runs = {w: peak_per_rank(w, images, Path(tmp) / str(round_)) for w in (1, 2, 4)}
            bank = runs[1][0]["bank_bytes"]  # one process's bank: every row in 13 float32 banks (memory model)
            work = runs[1][0]["grown"] - bank  # what else one process needed: queries, scoring, feature batches
            for w in (1, 2, 4):
                grown[w].append(max(rank["grown"] for rank in runs[w]))
            for w in (2, 4):
                ratios[w].append((grown[w][-1] - work) / (bank / w))
    mib = {w: statistics.median(v) / 2 ** 20 for w, v in grown.items()}
    return [ratio_row(section, f"kNN bank memory per rank at {w} processes, beyond one process's work memory / "
                               f"(1 process's bank / {w})", ratios[w], "<= 1.1",
                      f"{images:,} x 768 in 13 float32 banks ({bank / 2 ** 20:.0f} MiB); median peak growth of the "
                      f"largest rank {mib[w]:.0f} MiB, of one process {mib[1]:.0f} MiB (its bank and its work memory: "
                      f"queries {runs[1][0]['queries_bytes'] / 2 ** 20:.0f}, scoring "
                      f"{runs[1][0]['scoring_bytes'] / 2 ** 20:.0f}, feature batches and the rest)",
                      raw={"grown": {str(w): v for w, v in grown.items()}})
            for w in (2, 4)]


def imagenet_rows(settings: Settings) -> list[Row]:
    """ImageNet-1K's kNN on a GPU: a 1,281,167 x 768 bank (ViT-B's features, float32, on the GPU as a
    fit keeps it) scored against 50,000 queries at k = 20, one pass; ``blocks: all`` of a ViT-B is 13
    such passes (the features and 12 blocks)."""
    section = "kNN bank at scale"
    name = "kNN scoring on CUDA, ImageNet-1K: 1,281,167 x 768 bank, 50,000 queries, k=20 (seconds a pass)"
    if not settings.on_cuda:
        return [skipped(section, name, "needs a CUDA device (python -m benchmarks --device cuda --only knn)")]
    bank_rows, queries_count = settings.pick((1_281_167, 50_000), (20_000, 1_000))
    device = settings.torch_device
    bank, labels, queries, query_labels = synthetic_bank(bank_rows, queries_count, device)
    budget = 4096 * 2 ** 20  # a GPU's budget: KNNEvaluator(scoring_mib=4096)

    def one_pass() -> None:
        sims, found, _ = local_neighbours(bank, labels, queries, 20, budget)
        correct_counts(sims, found, query_labels, 1000, [20], 0.07, (1, 5), budget)

    seconds = interleaved({"pass": one_pass}, rounds=settings.pick(3, 1), warmup=1, device=device)["pass"]
    return [ratio_row(section, name, seconds, None,
                      f"{bank_rows:,} x {queries_count:,}; blocks: all of a ViT-B (13 passes) "
                      f"{13 * statistics.median(seconds):.0f} s; scoring_mib 4096", unit="s")]


def run(settings: Settings) -> list[Row]:
    return scoring_rows(settings) + imagenet_rows(settings) + dtype_rows(settings) + memory_rows(settings)
