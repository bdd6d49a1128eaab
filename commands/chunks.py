"""Convert an ImageFolder split tree (ImageNet's ``train/`` and ``val/``) into streaming chunks, once.

    shortcutlab chunks data/imagenet data/imagenet-chunks
    shortcutlab chunks data/imagenet s3://bucket/imagenet-chunks
    shortcutlab chunks data/imagenet data/imagenet100-chunks --class_list configs/data/imagenet100.txt

Each split becomes a litdata dataset (``DEST/train``, ``DEST/val``), written by ``litdata.optimize``
straight to a folder or to object storage (``s3://``, ``gs://``): chunk files of about
``--chunk_bytes`` holding every image's original bytes (no re-encoding), its label (its class's
position in the class list, or in the sorted class folders) and its file name, and an
``index.json`` that also records the class list. ``data.init_args.data_dir: DEST`` then trains,
validates and builds the kNN bank from the chunks (:mod:`datamodules.streamed_images`).

The chunks hold the images spread over the classes (:func:`datamodules.streamed_images.spread_stride`),
so that a chunk, and a batch read from one, mixes every class; the datamodule still gives sample
``i`` of the ImageFolder as sample ``i``. ``--num_workers`` processes convert with litdata's
progress bar; an interrupted conversion, run again, resumes from litdata's checkpoints
(``use_checkpoint``); a finished one says so and does nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

from torchvision.datasets.folder import IMG_EXTENSIONS

import lightning_mods.exit_statuses as exit_statuses
from datamodules.imagenet import read_class_list, subfolders
from datamodules.streamed_images import ENTRY, FORMAT, INDEX, SPLITS, is_uri, spread_stride, split_location
from lightning_mods.checkpointing.atomic_files import write_text_atomically

Sample = tuple[str, int, str]  # (file, label, name relative to SOURCE)
CHECKPOINTS = ".checkpoints"  # litdata's resume state, beside the chunks while a conversion runs
DATA_FORMAT = ["bytes", "int", "bytes"]  # how litdata's index records a sample's image, label and name


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
    unreadable = next((path for path, _, _ in samples if not os.access(path, os.R_OK)), None)
    if unreadable is not None:
        raise ConversionError(f"chunks: cannot read '{unreadable}' (permission denied)")
    return samples


class ReadSample:
    """litdata's ``fn``: the stored sample at a position (the image of the ImageFolder sample that
    position holds). A file that cannot be read is written down in ``failures`` (a local folder)
    instead of raised: litdata's workers would wait for it forever."""

    def __init__(self, samples: list[Sample], failures: str) -> None:
        self.samples, self.failures = samples, failures
        self.stride = spread_stride(len(samples))

    def __call__(self, position: int) -> dict[str, Any]:
        path, label, name = self.samples[position * self.stride % len(self.samples)]
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            Path(self.failures, str(position)).write_text(f"cannot read '{path}' ({err.strerror or err})")
            data, label = b"", -1
        return {"image": data, "label": label, "name": name.encode()}


class Destination:
    """A split's folder or URI: its ``index.json`` read, written and removed where it lives."""

    def __init__(self, location: str, storage_options: dict[str, Any]) -> None:
        self.location, self.storage_options = location, storage_options
        self.store = None
        if is_uri(location):
            from lightning_mods._compat.library_private import object_store

            self.store = object_store(location, storage_options)

    def path(self, name: str) -> str:
        return f"{self.location.rstrip('/')}/{name}" if self.store else os.path.join(self.location, name)

    def exists(self, name: str) -> bool:
        return self.store.exists(self.path(name)) if self.store else os.path.exists(self.path(name))

    def read_index(self) -> Optional[dict[str, Any]]:
        if not self.exists(INDEX):
            return None
        if not self.store:
            return json.loads(Path(self.path(INDEX)).read_text())
        with tempfile.TemporaryDirectory() as folder:
            self.store.download_file(self.path(INDEX), os.path.join(folder, INDEX))
            return json.loads(Path(folder, INDEX).read_text())

    def write_index(self, content: dict[str, Any]) -> None:
        text = json.dumps(content)
        if not self.store:
            write_text_atomically(Path(self.path(INDEX)), text)
            return
        with tempfile.TemporaryDirectory() as folder:  # one PUT: the object is whole or not there
            Path(folder, INDEX).write_text(text)
            self.store.upload_file(os.path.join(folder, INDEX), self.path(INDEX))

    def remove_index(self) -> None:
        if self.store:
            self.store.delete_file_or_directory(self.path(INDEX))
        else:
            Path(self.path(INDEX)).unlink(missing_ok=True)


def finished(index: Optional[dict[str, Any]], classes: list[str], num_samples: int, location: str) -> bool:
    """Whether ``index`` is this conversion finished (a one-line error when it converted other
    classes or another number of images)."""
    if index is None or ENTRY not in index:
        return False
    entry = index[ENTRY]
    if entry.get("classes") != classes or entry.get("num_samples") != num_samples:
        raise ConversionError(f"chunks: '{location}' is already a conversion of {len(entry.get('classes') or [])} "
                              f"classes and {entry.get('num_samples')} images, the source has {len(classes)} and "
                              f"{num_samples}; choose another DEST")
    return True


def optimize(samples: list[Sample], destination: Destination, args: argparse.Namespace) -> None:
    """litdata writes the split's chunks and index (resuming from its checkpoints); a file that
    could not be read leaves no index and is one line."""
    import litdata

    failures = tempfile.mkdtemp(prefix="shortcutlab-chunks-")
    before = dict(os.environ)
    try:
        litdata.optimize(fn=ReadSample(samples, failures), inputs=list(range(len(samples))),
                         output_dir=destination.location,
                         chunk_bytes=args.chunk_bytes, num_workers=args.num_workers or os.cpu_count() or 1,
                         use_checkpoint=True, reorder_files=False, verbose=args.progress,
                         start_method="fork" if sys.platform == "linux" else "spawn",
                         storage_options=args.storage_options)
        failed = sorted(os.listdir(failures), key=int)
        if failed:
            destination.remove_index()
            raise ConversionError(f"chunks: {Path(failures, failed[0]).read_text()}; "
                                  f"{len(failed)} image(s) not converted, nothing finished")
    finally:
        shutil.rmtree(failures, ignore_errors=True)
        os.environ.clear()  # litdata sets its optimizer's variables in the calling process
        os.environ.update(before)


def convert_split(source: Path, dest: str, split: str, classes: list[str], args: argparse.Namespace) -> str:
    """Convert one split (what is not finished yet); the line that says what was done."""
    samples = split_samples(source, split, classes)
    location = split_location(dest, split)
    try:
        return write_split(source, samples, location, split, classes, args)
    except (ConversionError, KeyboardInterrupt):
        raise
    except Exception as err:  # noqa: BLE001 (the storage clients' many errors: one line naming the destination)
        lines = str(err).strip().splitlines() or [""]
        raise ConversionError(f"chunks: cannot write to '{location}' ({type(err).__name__}: {lines[-1][:300]})") \
            from None


def write_split(source: Path, samples: list[Sample], location: str, split: str, classes: list[str],
                args: argparse.Namespace) -> str:
    destination = Destination(location, args.storage_options)
    index = destination.read_index()
    if finished(index, classes, len(samples), location):
        return f"{split}: already converted ({len(samples)} images in {len(index['chunks'])} chunks)"
    if index is not None and index.get("config", {}).get("data_format") != DATA_FORMAT:
        raise ConversionError(f"chunks: '{location}' already holds another litdata dataset; choose another DEST")
    resumed = destination.exists(f"{CHECKPOINTS}/config.json")
    if index is None or sum(int(c["chunk_size"]) for c in index["chunks"]) != len(samples):
        if not is_uri(location):
            Path(location).mkdir(parents=True, exist_ok=True)
        optimize(samples, destination, args)
        index = destination.read_index()
    entry = {"format": FORMAT, "classes": classes, "num_samples": len(samples), "source": str(source),
             "stride": spread_stride(len(samples))}
    destination.write_index({**index, ENTRY: entry})
    return f"{split}: {len(samples)} images in {len(index['chunks'])} chunks" + \
        (", resumed from an interrupted run" if resumed else "")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shortcutlab chunks", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the ImageFolder split tree: SOURCE/train/<class>/<image>, SOURCE/val/...")
    parser.add_argument("dest", help="the conversion's folder or URI (DEST/train, DEST/val)")
    parser.add_argument("--class_list", default=None, help="a file of the classes to convert, one per line, in label "
                                                            "order (ImageNet-100's); default: every train class folder")
    parser.add_argument("--num_workers", type=int, default=None, help="processes (default: the cores)")
    parser.add_argument("--chunk_bytes", default="64MB", help="the size of a chunk file (litdata's chunk_bytes)")
    parser.add_argument("--storage_options", type=json.loads, default={},
                        help="litdata's storage_options for a URI, as JSON (default: the storage's usual environment)")
    parser.add_argument("--no_progress", dest="progress", action="store_false", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    try:
        source, dest = args.source.resolve(), args.dest if is_uri(args.dest) else str(Path(args.dest))
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
