"""An ImageFolder split read from the chunks ``shortcutlab chunks`` wrote (litdata's format): a few
large files instead of one file an image, on local disk, a shared filesystem or object storage.

A conversion is a folder (or URI) holding ``train/`` and ``val/``, each a litdata dataset: chunk
files of the images' original bytes (no re-encoding), their labels and their file names, and an
``index.json`` that also names the class list and the stride the samples are stored at (the
``shortcutlab`` entry, :func:`spread_stride`). :class:`StreamedSplit` is a map-style dataset over
one split's stored images and labels (:class:`StreamedImages` decodes them; numbered as the
ImageFolder from a folder, as stored from object storage), so the package's own samplers decide the order: every
sample once per epoch across ranks and nodes, in an order seeded by epoch, and a mid-epoch resume
hands out exactly the batches left (:mod:`datamodules.resumable`). litdata reads each sample from
its chunk: in place on a local or shared disk; from object storage (``s3://``, ``gs://``, ...) it
fetches the whole chunk into its cache (``cache_dir``, ``max_cache_size``), which the chunk-by-chunk
training order (:mod:`datamodules.chunk_order`) reads before moving on.
"""
from __future__ import annotations

import functools
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from torch.utils.data import Dataset

from datamodules._stored_image import ImageSource, StoredImage, first_readable
from lightning_mods._compat.library_private import read_whole_chunks

FORMAT = "shortcutlab-chunks/1"
EARLIER_FORMATS = ("shortcutlab-shards/1",)  # the same layout, written before the command was `chunks`
ENTRY = "shortcutlab"  # the conversion's own entry in litdata's index.json
SPLITS = ("train", "val")
INDEX = "index.json"
REACH_SECONDS = 120.0  # how long reaching object storage's index may take before it is a one-line error


def spread_stride(num_samples: int) -> int:
    """The stride a conversion stores its samples at: position ``s`` holds ImageFolder sample
    ``s * stride mod n``. Coprime with ``n`` (every sample once) and near ``n / golden ratio``, so
    that consecutive positions, and so every chunk, spread over the whole class-sorted tree."""
    stride = max(1, round(num_samples / (1 + 5 ** 0.5) * 2))
    while math.gcd(stride, num_samples) != 1:
        stride += 1
    return stride


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
    stride: int = 1  # see spread_stride (1: stored in ImageFolder order, as conversions before 0.3)

    @property
    def numbered_as_stored(self) -> bool:
        """Whether sample ``i`` is the one stored at position ``i`` (in object storage: a pass in
        index order then reads chunk by chunk) rather than the ImageFolder's sample ``i`` (a folder)."""
        return is_uri(self.location)

    @functools.cached_property
    def _inverse_stride(self) -> int:
        return pow(self.stride, -1, self.num_samples)

    def position(self, index: int) -> int:
        """Where sample ``index`` is stored."""
        if self.numbered_as_stored or self.stride == 1:
            return index
        return index * self._inverse_stride % self.num_samples

    def index_at(self, position: int) -> int:
        """The sample number of the sample stored at ``position``."""
        return position if self.numbered_as_stored else self.source_index(position)

    def source_index(self, position: int) -> int:
        """The ImageFolder sample stored at ``position``."""
        return position * self.stride % self.num_samples


def read_conversion(location: str, cache_dir: Optional[str] = None,
                    storage_options: Optional[dict[str, Any]] = None) -> Conversion:
    """The conversion at ``location`` (a split's folder or URI), checked: a one-line error when it
    cannot be reached, is not a finished conversion, or a local chunk is missing or truncated."""
    index = _index_file(location, cache_dir, storage_options)
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
                            str(entry.get("source", "")), int(entry.get("stride", 1)))
    if not is_uri(location):
        for chunk in conversion.chunks:
            path = os.path.join(location, chunk["filename"])
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size != int(chunk["chunk_bytes"]):
                state = "missing" if size is None else f"truncated ({size} of {chunk['chunk_bytes']} bytes)"
                raise ValueError(f"ImageNet: chunk '{path}' is {state}; convert again (`shortcutlab chunks`) or copy "
                                 "the conversion again")
    return conversion


def _index_file(location: str, cache_dir: Optional[str], storage_options: Optional[dict[str, Any]]) -> str:
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
            found["index"] = os.path.join(StreamingDataset(location, cache_dir=cache_dir,
                                                           storage_options=storage_options).input_dir.path, INDEX)
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
    """The ``(StoredImage, label)`` samples of one converted split; the litdata reader is opened in
    each process that reads (the loader's workers included).

    From a folder sample ``i`` is the ImageFolder's sample ``i``, read in place. From object
    storage sample ``i`` is the one stored at position ``i`` (the same samples, numbered chunk by
    chunk, so that an evaluation pass in index order reads each chunk once): its whole chunk is
    downloaded into litdata's cache once and read from there (a sample alone would cost one
    request), and the training order goes chunk by chunk (:class:`datamodules.chunk_order.ChunkOrder`).

    Args:
        conversion: the split (:func:`read_conversion`).
        cache_dir: where chunks downloaded from object storage are kept (None: litdata's default).
        max_cache_size: the most those may take on disk (litdata's ``max_cache_size``, e.g. ``"100GB"``);
            past it a chunk is deleted once read.
        storage_options: litdata's options of the object store (endpoint, credentials; None: the
            storage's usual environment variables).
    """

    def __init__(self, conversion: Conversion, cache_dir: Optional[str] = None, max_cache_size: str = "100GB",
                 storage_options: Optional[dict[str, Any]] = None) -> None:
        self.conversion, self.cache_dir, self.max_cache_size = conversion, cache_dir, max_cache_size
        self.storage_options = storage_options
        self.root = conversion.location
        self.remote = is_uri(conversion.location)
        self._stream: Any = None
        self._reader_pid: Optional[int] = None  # the process that opened it

    def __len__(self) -> int:
        return self.conversion.num_samples

    @property
    def chunk_sizes(self) -> list[int]:
        """The samples of each chunk, in stored order."""
        return [int(chunk["chunk_size"]) for chunk in self.conversion.chunks]

    def _reader(self) -> Any:
        if self._stream is None or self._reader_pid != os.getpid():  # a forked worker opens its own
            from litdata import StreamingDataset

            self._reader_pid = os.getpid()
            self._stream = StreamingDataset(self.conversion.location, cache_dir=self.cache_dir,
                                            max_cache_size=self.max_cache_size, storage_options=self.storage_options)
            if self.remote:
                read_whole_chunks(self._stream)
        return self._stream

    def __getitem__(self, index: int) -> tuple[StoredImage, int]:
        position = self.conversion.position(int(index))
        from litdata.exceptions import ChunkWaitTimeoutError

        try:
            item = self._reader()[position]
        except ChunkWaitTimeoutError as err:
            raise ChunkError(self._unarrived(err)) from None
        name = f"{self.conversion.location} sample {index} ({item['name'].decode()})"
        return StoredImage(name, item["image"]), int(item["label"])

    def __getstate__(self) -> dict[str, Any]:  # a worker opens its own reader
        return {**self.__dict__, "_stream": None}

    def _unarrived(self, err: Any) -> str:
        """The one line for a chunk that did not arrive whole within litdata's ``MAX_WAIT_TIME``."""
        name = os.path.basename(err.path)
        expected = next((int(c["chunk_bytes"]) for c in self.conversion.chunks if c["filename"] == name), None)
        size = os.path.getsize(err.path) if os.path.isfile(err.path) else None
        state = f"truncated ({size} of {expected} bytes)" if size is not None and expected and size < expected \
            else f"not downloaded within {err.waited_s:.0f} s (litdata's MAX_WAIT_TIME)"
        return (f"ImageNet: chunk '{self.conversion.location}/{name}' is {state}; convert again "
                "(`shortcutlab chunks`) or copy the conversion again")


class ChunkError(ValueError):
    """A chunk of a conversion in object storage that cannot be read whole (one line)."""


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
