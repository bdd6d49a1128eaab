"""``shortcutlab score-bank``: score a saved kNN bank again, at other ``k``, temperatures or blocks,
without embedding the training set again (DINO's ``--load_features``).

    shortcutlab validate --config configs/digits_mae.yaml --ckpt_path last.ckpt \\
        --trainer.callbacks+=KNNEvaluator --trainer.callbacks.save_features=bank/
    shortcutlab score-bank bank/ --k 10 20 100 200 --temperature 0.04 --blocks all

The folder is what ``KNNEvaluator(save_features=...)`` wrote at its last evaluation: one file of
bank rows per rank (``bank-rank*-of-*.pt``) and the queries (``queries.pt``). The shards are read
one at a time and their top-k merged, as the ranks' are during a run, so the command needs the
memory of one shard, not of the whole bank; the accuracies equal the run's at the same settings.
The scoring runs on ``--device`` (a GPU when there is one): the queries live there, and each
shard's rows are brought over from host memory a part at a time, within ``--scoring-mib``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import lightning_mods.exit_statuses as exit_statuses
from commands._progress import command_progress, show_progress, tracked

if TYPE_CHECKING:
    import torch
    from rich.progress import Progress


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shortcutlab score-bank", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("folder", type=Path, help="the folder KNNEvaluator(save_features=...) wrote")
    parser.add_argument("--k", type=int, nargs="+", default=[20], help="neighbours, one or several (default 20)")
    parser.add_argument("--temperature", type=float, default=0.07, help="of the weights exp(s / T) (default 0.07)")
    parser.add_argument("--blocks", nargs="+", default=None,
                        help="also score these blocks: all, or indices (1 = nearest the input, -1 = the last)")
    parser.add_argument("--scoring-mib", type=int, default=256, help="work memory of the scoring (default 256)")
    parser.add_argument("--device", default="auto",
                        help="where to score: auto (the first GPU when there is one, else the CPU), cpu, cuda, cuda:N")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn off a terminal either)")
    return parser


def shard_files(folder: Path) -> list[Path]:
    """The bank's files, in rank order; ``ValueError`` (one line) unless they are one complete set."""
    from callbacks.measurement.knn_bank import QUERIES_FILE

    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder")
    files = sorted(folder.glob("bank-rank*-of-*.pt"))
    if not files or not (folder / QUERIES_FILE).is_file():
        raise ValueError(f"{folder}: no saved kNN bank here (bank-rank*-of-*.pt and {QUERIES_FILE}, written by "
                         "KNNEvaluator(save_features=...))")
    sizes = {f.stem.rpartition("-of-")[2] for f in files}
    world_size = int(sizes.pop()) if len(sizes) == 1 else None
    if world_size is None or len(files) != world_size:
        raise ValueError(f"{folder}: {len(files)} bank files, not one complete set of ranks ({[f.name for f in files]})")
    return files


def chosen_blocks(given: Optional[list[str]], count: int) -> list[int]:
    from lightning_mods.evaluation.over_depth import check_blocks, resolve_blocks

    if not given:
        return []
    blocks = "all" if given == ["all"] else [int(b) for b in given]
    if count == 0:
        raise ValueError("--blocks: the bank was saved without block features (KNNEvaluator blocks: null)")
    return resolve_blocks("shortcutlab score-bank --blocks", check_blocks("shortcutlab score-bank --blocks", blocks), count)


def scoring_device(name: str) -> "torch.device":
    """``--device``: ``auto`` is the first GPU when there is one, else the CPU; a GPU asked for on a
    machine without one is a ValueError (one line)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"--device {name}: no such CUDA device here ({torch.cuda.device_count()} visible)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {name!r}")
    return device


def score(folder: Path, ks: list[int], temperature: float, blocks: Optional[list[str]],
          budget_bytes: int, progress: Optional["Progress"] = None,
          device: str = "cpu") -> list[tuple[str, dict[str, float]]]:
    """``[(what, {"top1@k=..": ..., "top5@k=..": ...}), ...]`` for the features and each chosen block,
    scored on ``device`` (:func:`scoring_device`)."""
    import torch

    from callbacks.measurement.knn_bank import QUERIES_FILE, shard_index
    from callbacks.measurement.knn_scoring import (correct_counts, keep_best, local_neighbours, neighbour_count,
                                                   normalized_queries)

    if any(k < 1 for k in ks) or not temperature > 0:
        raise ValueError(f"--k must be >= 1 and --temperature > 0, got {ks} and {temperature}")
    files = shard_files(folder)
    queries = torch.load(folder / QUERIES_FILE, weights_only=True, mmap=True)
    num_classes = int(queries.get("num_classes") or int(queries["labels"].max()) + 1)
    chosen = chosen_blocks(blocks, len(queries["blocks"] or []))
    matrices = [("features", queries["features"])] + [(f"block {b}", queries["blocks"][b - 1]) for b in chosen]
    where = scoring_device(device)
    normalized = [normalized_queries(q, where) for _, q in matrices]
    totals = set()
    found: list[Optional[tuple]] = [None] * len(matrices)
    kmax = max(ks)
    for path in tracked(progress, files, "bank files scored"):
        shard = torch.load(path, weights_only=True, mmap=True)
        totals.add(int(shard["total"]))
        rows = [shard["features"]] + [shard["blocks"][b - 1] for b in chosen]
        index, block_rows = shard_index(shard), shard.get("block_rows")
        for i, (bank, q) in enumerate(zip(rows, normalized)):
            this_shard = local_neighbours(bank, shard["labels"], q, kmax, budget_bytes, bank_index=index,
                                          block_rows=block_rows)
            found[i] = this_shard if found[i] is None else keep_best(found[i], this_shard, kmax)
    if len(totals) != 1:
        raise ValueError(f"{folder}: the bank files come from different evaluations (bank sizes {sorted(totals)})")
    total = totals.pop()
    used, tops = [min(k, total) for k in ks], ((1, 5) if num_classes > 5 else (1,))
    results = []
    for (what, _), neighbours in zip(matrices, found):
        sims, labels = neighbours.sims[:, :neighbour_count(ks, total)], neighbours.labels[:, :neighbour_count(ks, total)]
        counts = correct_counts(sims, labels, queries["labels"].to(where), num_classes, used, temperature, tops,
                                budget_bytes)
        names = [f"top{top}@k={k}" for k in ks for top in tops]
        results.append((what, {name: int(c) / len(queries["labels"]) for name, c in zip(names, counts.tolist())}))
    return results


def table(results: list[tuple[str, dict[str, float]]]) -> str:
    names = list(results[0][1])
    width = max(len(what) for what, _ in results)
    lines = [" " * width + "  " + "  ".join(f"{n:>11}" for n in names)]
    lines += [f"{what:<{width}}  " + "  ".join(f"{100 * v:10.2f}%" for v in values.values()) for what, values in results]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        with command_progress(show_progress(args.quiet)) as progress:
            results = score(args.folder, args.k, args.temperature, args.blocks, args.scoring_mib * 2 ** 20, progress,
                            args.device)
    except (ValueError, OSError) as err:
        print(f"shortcutlab score-bank: error: {err}", file=sys.stderr)
        sys.exit(exit_statuses.BAD_INPUT)
    print(table(results))


if __name__ == "__main__":
    main()
