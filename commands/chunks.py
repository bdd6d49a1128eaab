"""Convert an ImageFolder split tree (ImageNet's ``train/`` and ``val/``) into streaming chunks, once.

    shortcutlab chunks data/imagenet data/imagenet-chunks
    shortcutlab chunks data/imagenet data/imagenet100-chunks --class_list configs/data/imagenet100.txt

Each split becomes a litdata dataset (``DEST/train``, ``DEST/val``): chunk files of about
``--chunk_bytes`` holding every image's original bytes (no re-encoding), its label (its class's
position in the class list, or in the sorted class folders) and its file name, and an
``index.json`` that also records the class list. ``data.init_args.data_dir: DEST`` (or the URI
it is copied to) then trains, validates and builds the kNN bank from the chunks
(:mod:`datamodules.streamed_images`).

The images are converted in parts of ``--part_size`` images by ``--num_workers`` processes, with a
progress bar. A part is finished once its index is written; an interrupted conversion, run
again, keeps the finished parts and converts the rest; a finished one says so and does nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import queue
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torchvision.datasets.folder import IMG_EXTENSIONS

import lightning_mods.exit_statuses as exit_statuses
from datamodules.imagenet import read_class_list, subfolders
from datamodules.streamed_images import ENTRY, FORMAT, INDEX, SPLITS
from lightning_mods.checkpointing.atomic_files import write_text_atomically

RANK_VARIABLE = "DATA_OPTIMIZER_GLOBAL_RANK"  # litdata's writer names a part's chunks and index by it

Sample = tuple[str, int, str]  # (file, label, name relative to SOURCE)


class ConversionError(ValueError):
    """A source, class list or destination the conversion cannot use (one line)."""


def split_samples(source: Path, split: str, classes: list[str]) -> list[Sample]:
    """Every image of ``source/split`` in class-list order, each class's files sorted by name."""
    samples = []
    for label, name in enumerate(classes):
        folder = source / split / name
        if not folder.is_dir():
            raise ConversionError(f"chunks: class '{name}' has no folder under '{source / split}'")
        files = sorted(f for f in os.listdir(folder) if f.lower().endswith(IMG_EXTENSIONS))
        samples += [(str(folder / f), label, f"{split}/{name}/{f}") for f in files]
    if not samples:
        raise ConversionError(f"chunks: no images under '{source / split}'")
    return samples


def finished_part(split_dir: Path, part: int) -> Optional[dict]:
    """Part ``part``'s index when the part is finished (its index reads and every chunk it names
    has its full size), else None."""
    try:
        index = json.loads((split_dir / f"{part}.{INDEX}").read_text())
    except (OSError, ValueError):
        return None
    for chunk in index.get("chunks", []):
        path = split_dir / chunk["filename"]
        if not path.is_file() or path.stat().st_size != int(chunk["chunk_bytes"]):
            return None
    return index


def convert_part(task: tuple[str, int, list[Sample], int]) -> int:
    """Write one part's chunks and its index (litdata's ``BinaryWriter``, chunk files named by the
    part); returns its number of images."""
    from litdata.streaming.writer import BinaryWriter

    split_dir, part, samples, chunk_bytes = task
    for leftover in Path(split_dir).glob(f"chunk-{part}-*"):  # an interrupted run's
        leftover.unlink()
    with writer_rank(part):  # the writer names its chunks and index by it
        writer = BinaryWriter(split_dir, chunk_bytes=chunk_bytes, msg_queue=queue.SimpleQueue())  # notes: not printed
        for i, (path, label, name) in enumerate(samples):
            try:
                data = Path(path).read_bytes()
            except OSError as err:
                raise ConversionError(f"chunks: cannot read '{path}' ({err.strerror or err})") from None
            writer[i] = {"image": data, "label": label, "name": name.encode()}
        writer.done()
    return len(samples)


@contextlib.contextmanager
def writer_rank(part: int) -> Iterator[None]:
    """litdata's ``DATA_OPTIMIZER_GLOBAL_RANK`` set to ``part`` while a part is written, as it was
    afterwards (with one worker the part is written in the command's own process, whose
    environment ``StreamingDataset`` reads later)."""
    before = os.environ.get(RANK_VARIABLE)
    os.environ[RANK_VARIABLE] = str(part)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RANK_VARIABLE, None)
        else:
            os.environ[RANK_VARIABLE] = before


def write_index(split_dir: Path, parts: int, classes: list[str], num_samples: int, source: Path) -> int:
    """The split's ``index.json``: the parts' chunks in order, with the conversion's entry; then
    the parts' own indexes go (a kill in between leaves a finished split). Returns its chunks."""
    chunks, config = [], None
    for part in range(parts):
        index = finished_part(split_dir, part)
        chunks += index["chunks"]
        config = config or index["config"]
    entry = {"format": FORMAT, "classes": classes, "num_samples": num_samples, "source": str(source)}
    write_text_atomically(split_dir / INDEX, json.dumps({"chunks": chunks, "config": config, ENTRY: entry}))
    for part in range(parts):
        (split_dir / f"{part}.{INDEX}").unlink(missing_ok=True)
    return len(chunks)


def existing_conversion(split_dir: Path, classes: list[str], num_samples: int) -> Optional[int]:
    """The number of chunks of a finished conversion of this split at ``split_dir``; None when
    there is none; a one-line error when it converted other classes or another number of images."""
    try:
        index = json.loads((split_dir / INDEX).read_text())
    except (OSError, ValueError):
        return None
    entry = index.get(ENTRY) or {}
    if entry.get("classes") != classes or entry.get("num_samples") != num_samples:
        raise ConversionError(f"chunks: '{split_dir}' is already a conversion of {len(entry.get('classes') or [])} classes "
                          f"and {entry.get('num_samples')} images, the source has {len(classes)} and {num_samples}; "
                          "choose another DEST")
    return len(index["chunks"])


def convert_split(source: Path, dest: Path, split: str, classes: list[str], args: argparse.Namespace) -> str:
    """Convert one split (what is not finished yet); the line that says what was done."""
    samples = split_samples(source, split, classes)
    split_dir = dest / split
    done = existing_conversion(split_dir, classes, len(samples))
    if done is not None:
        return f"{split}: already converted ({len(samples)} images in {done} chunks)"
    split_dir.mkdir(parents=True, exist_ok=True)
    parts = [samples[i:i + args.part_size] for i in range(0, len(samples), args.part_size)]
    pending = [p for p in range(len(parts)) if finished_part(split_dir, p) is None]
    tasks = [(str(split_dir), p, parts[p], args.chunk_bytes) for p in pending]
    kept = sum(len(parts[p]) for p in range(len(parts)) if p not in pending)
    columns = (TextColumn(f"chunks {split}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not args.progress) as progress:
        bar = progress.add_task(split, total=len(samples), completed=kept)
        workers = max(1, min(args.num_workers or os.cpu_count() or 1, len(tasks)))
        if workers == 1:
            for task in tasks:
                progress.advance(bar, convert_part(task))
        else:
            context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
            with context.Pool(workers) as pool:
                for converted in pool.imap_unordered(convert_part, tasks):
                    progress.advance(bar, converted)
    chunks = write_index(split_dir, len(parts), classes, len(samples), source)
    resumed = f", {len(parts) - len(pending)} of {len(parts)} parts kept from an earlier run" if kept else ""
    return f"{split}: {len(samples)} images in {chunks} chunks{resumed}"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shortcutlab chunks", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the ImageFolder split tree: SOURCE/train/<class>/<image>, SOURCE/val/...")
    parser.add_argument("dest", type=Path, help="the conversion's folder (DEST/train, DEST/val)")
    parser.add_argument("--class_list", default=None, help="a file of the classes to convert, one per line, in label "
                                                            "order (ImageNet-100's); default: every train class folder")
    parser.add_argument("--num_workers", type=int, default=None, help="processes (default: the cores)")
    parser.add_argument("--chunk_bytes", default="64MB", help="the size of a chunk file (litdata's chunk_bytes)")
    parser.add_argument("--part_size", type=int, default=5000, help="images a part (what a resumed run keeps)")
    parser.add_argument("--no_progress", dest="progress", action="store_false", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    try:
        if args.part_size < 1:
            raise ConversionError(f"chunks: --part_size must be >= 1, got {args.part_size}")
        source, dest = args.source.resolve(), args.dest
        if not (source / "train").is_dir() or not (source / "val").is_dir():
            raise ConversionError(f"chunks: '{source}' has no train/ and val/ class folders")
        classes = read_class_list(args.class_list) if args.class_list else subfolders(str(source / "train"))
        lines = [convert_split(source, dest, split, classes, args) for split in SPLITS]
    except (ConversionError, ValueError, FileNotFoundError) as err:
        print(f"shortcutlab: error: {str(err).replace('ImageNet: ', 'chunks: ', 1)}", file=sys.stderr)
        sys.exit(exit_statuses.BAD_INPUT)
    print(f"shortcutlab chunks: {dest} holds {len(classes)} classes; " + "; ".join(lines))


if __name__ == "__main__":
    main()
