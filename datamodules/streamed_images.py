"""An ImageFolder split read from the chunks ``shortcutlab chunks`` wrote (litdata's format): a few
large files instead of one file an image, on local disk, a shared filesystem or object storage.

A conversion is a folder (or URI) holding ``train/`` and ``val/``, each a litdata dataset: chunk
files of the images' original bytes (no re-encoding), their labels and their file names, and an
``index.json`` that also names the class list (the ``shortcutlab`` entry). :class:`StreamedSplit`
is a map-style dataset over one split's stored images and labels (:class:`StreamedImages` decodes
them), so the package's own samplers decide the order: every
sample once per epoch across ranks and nodes, in an order seeded by epoch, and a mid-epoch resume
hands out exactly the batches left (:mod:`datamodules.resumable`). litdata reads each sample from
its chunk: in place on a local or shared disk; from object storage (``s3://``, ``gs://``, ...)
through its cache of downloaded chunks (``cache_dir``, ``max_cache_size``).
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from torch.utils.data import Dataset

from datamodules._stored_image import ImageSource, StoredImage, first_readable

FORMAT = "shortcutlab-chunks/1"
EARLIER_FORMATS = ("shortcutlab-shards/1",)  # the same layout, written before the command was `chunks`
ENTRY = "shortcutlab"  # the conversion's own entry in litdata's index.json
SPLITS = ("train", "val")
INDEX = "index.json"
REACH_SECONDS = 120.0  # how long reaching object storage's index may take before it is a one-line error


def is_uri(location: str) -> bool:
    return "://" in str(location)


def is_conversion(data_dir: str) -> bool:
    """Whether ``data_dir`` names a conversion (a URI, or a folder whose ``train/`` holds litdata
    files) rather than an ImageFolder tree."""
    if is_uri(data_dir):
        return True
    train = Path(data_dir) / "train"
    return train.is_dir() and any(p.name.endswith(INDEX) or p.name.startswith("chunk-") for p in train.iterdir())


def split_location(data_dir: str, split: str) -> str:
    return f"{str(data_dir).rstrip('/')}/{split}" if is_uri(data_dir) else os.path.join(data_dir, split)


@dataclass(frozen=True)
class Conversion:
    """One converted split: where it is, its classes in label order, its samples and its chunks."""

    location: str
    classes: list[str]
    num_samples: int
    chunks: list[dict[str, Any]]
    source: str


def read_conversion(location: str, cache_dir: Optional[str] = None) -> Conversion:
    """The conversion at ``location`` (a split's folder or URI), checked: a one-line error when it
    cannot be reached, is not a finished conversion, or a local chunk is missing or truncated."""
    index = _index_file(location, cache_dir)
    try:
        with open(index) as f:
            content = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"ImageNet: '{location}' has an unreadable {INDEX} ({err})") from None
    entry = content.get(ENTRY)
    if not isinstance(entry, dict) or entry.get("format") not in (FORMAT, *EARLIER_FORMATS):
        raise ValueError(f"ImageNet: '{location}' holds litdata chunks but is not a conversion of `shortcutlab chunks` "
                         f"(its {INDEX} has no '{ENTRY}' entry of format {FORMAT})")
    conversion = Conversion(location, list(entry["classes"]), int(entry["num_samples"]), list(content["chunks"]),
                            str(entry.get("source", "")))
    if not is_uri(location):
        for chunk in conversion.chunks:
            path = os.path.join(location, chunk["filename"])
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size != int(chunk["chunk_bytes"]):
                state = "missing" if size is None else f"truncated ({size} of {chunk['chunk_bytes']} bytes)"
                raise ValueError(f"ImageNet: chunk '{path}' is {state}; convert again (`shortcutlab chunks`) or copy "
                                 "the conversion again")
    return conversion


def _index_file(location: str, cache_dir: Optional[str]) -> str:
    """The local path of the split's ``index.json`` (downloaded into litdata's cache for a URI)."""
    if not is_uri(location):
        index = os.path.join(location, INDEX)
        if not os.path.isfile(index):
            leftovers = [p for p in os.listdir(location) if p.startswith("chunk-") or p.endswith(INDEX)] \
                if os.path.isdir(location) else []
            if leftovers:
                raise ValueError(f"ImageNet: '{location}' is an unfinished conversion (no {INDEX}); run "
                                 "`shortcutlab chunks SOURCE DEST` again to finish it")
            raise FileNotFoundError(f"ImageNet: no conversion at '{location}' (expected its {INDEX})")
        return index
    from litdata import StreamingDataset

    found: dict[str, Any] = {}

    def fetch() -> None:  # the storage client retries an unreachable endpoint for minutes: a deadline
        try:
            found["index"] = os.path.join(StreamingDataset(location, cache_dir=cache_dir).input_dir.path, INDEX)
        except Exception as err:  # noqa: BLE001 (the storage client's many errors: one line naming the URI)
            found["error"] = (str(err).strip().splitlines() or [type(err).__name__])[0]

    thread = threading.Thread(target=fetch, name="conversion-index", daemon=True)
    thread.start()
    thread.join(REACH_SECONDS)
    if "index" in found:
        return found["index"]
    reason = found.get("error", f"no answer within {REACH_SECONDS:g} s")
    raise FileNotFoundError(f"ImageNet: cannot read the conversion at '{location}' ({reason})")


class StreamedSplit(Dataset):
    """The ``(StoredImage, label)`` samples of one converted split, in the conversion's order; the
    litdata reader is opened in each process that reads (the loader's workers included).

    Args:
        conversion: the split (:func:`read_conversion`).
        cache_dir: where chunks downloaded from object storage are kept (None: litdata's default).
        max_cache_size: the most those may take on disk (litdata's ``max_cache_size``, e.g. ``"100GB"``).
    """

    def __init__(self, conversion: Conversion, cache_dir: Optional[str] = None, max_cache_size: str = "100GB") -> None:
        self.conversion, self.cache_dir, self.max_cache_size = conversion, cache_dir, max_cache_size
        self.root = conversion.location
        self._stream: Any = None
        self._reader_pid: Optional[int] = None  # the process that opened it

    def __len__(self) -> int:
        return self.conversion.num_samples

    def __getitem__(self, index: int) -> tuple[StoredImage, int]:
        if self._stream is None or self._reader_pid != os.getpid():  # a forked worker opens its own
            from litdata import StreamingDataset

            self._reader_pid = os.getpid()

            self._stream = StreamingDataset(self.conversion.location, cache_dir=self.cache_dir,
                                            max_cache_size=self.max_cache_size)
        item = self._stream[int(index)]
        name = f"{self.conversion.location} sample {index} ({item['name'].decode()})"
        return StoredImage(name, item["image"]), int(item["label"])

    def __getstate__(self) -> dict[str, Any]:  # a worker opens its own reader
        return {**self.__dict__, "_stream": None}


class StreamedImages(Dataset):
    """A converted split's images decoded by ``loader`` (as :class:`SelectedClassFolder` does a
    folder's), with the same ``skip_corrupt``."""

    def __init__(self, samples: StreamedSplit, loader: Callable[[ImageSource], Any], skip_corrupt: bool = False) -> None:
        self.samples, self.loader, self.skip_corrupt = samples, loader, skip_corrupt

    def __len__(self) -> int:
        return len(self.samples)

    def _read(self, index: int) -> tuple[Any, int]:
        source, label = self.samples[index]
        return self.loader(source), label

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return first_readable(self._read, index, len(self), self.skip_corrupt, self.samples.root)
