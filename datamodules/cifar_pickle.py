"""Reading CIFAR's python batches without running code from them (safe data files).

A CIFAR batch is a pickle, and ``pickle.load`` calls whatever a pickle names: a crafted
``data_batch_1`` runs code on the machine that reads it. The official files (Python 2,
protocol 2) and files rewritten by Python 3 hold only dicts, lists, strings, ints and uint8
numpy arrays, which need exactly these globals:

- ``numpy.core.multiarray._reconstruct`` (numpy 1 writers; ``numpy._core`` for numpy 2),
  ``numpy.ndarray`` and ``numpy.dtype``: the array ``data``;
- ``_codecs.encode`` with ``latin1``: how Python 3 writes ``bytes`` at protocol 2.

:class:`CIFARUnpickler` resolves only those (``_codecs.encode`` only for latin1, arrays
only of plain numeric dtypes), so anything else in a file stops the read before it is
called, with a one-line :class:`UnsafeDataFileError` naming the file.
"""
from __future__ import annotations

import codecs
import os
import pickle
from typing import Any, Callable

import numpy as np

from lightning_mods._compat.library_private import reconstruct_array


class UnsafeDataFileError(ValueError):
    """A data file is not in the expected format, or would run code when read."""


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles of ``bytes`` call it, latin1 only."""
    if codecs.lookup(encoding).name != "iso8859-1":
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r} (only latin1 writes bytes)")
    return text.encode("latin1")


def _plain_array(subtype: type, shape: Any, dtype: Any) -> np.ndarray:
    """``_reconstruct`` for plain ndarrays of numeric dtypes (never ``object``, which unpickles items)."""
    descr = np.dtype(dtype)
    if subtype is not np.ndarray or descr.hasobject:
        raise pickle.UnpicklingError(f"an array of {subtype.__name__} / dtype {descr} (CIFAR holds uint8 arrays)")
    return reconstruct_array(subtype, shape, dtype)


_ALLOWED: dict[tuple[str, str], Callable | type] = {
    ("numpy.core.multiarray", "_reconstruct"): _plain_array,
    ("numpy._core.multiarray", "_reconstruct"): _plain_array,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class CIFARUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals a CIFAR batch needs (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a CIFAR batch never holds") from None


def load_cifar_batch(path: str | os.PathLike, required: tuple[str, ...] = ()) -> dict:
    """The dict stored in the CIFAR batch ``path``, read by :class:`CIFARUnpickler`.

    Keys decode as ``latin1`` (the official files are Python 2 pickles). ``required`` keys
    must be present. Raises a one-line :class:`UnsafeDataFileError` naming the file when it
    is not such a dict, is truncated, or refers to anything outside the CIFAR structure.
    """
    try:
        with open(path, "rb") as f:
            batch = CIFARUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, OverflowError, MemoryError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UnsafeDataFileError(f"'{path}' is not a CIFAR python batch ({reason}); nothing in it was run") \
            from None
    if not isinstance(batch, dict):
        raise UnsafeDataFileError(f"'{path}' is not a CIFAR python batch (it holds a {type(batch).__name__}, "
                                  "not a dict)")
    missing = [key for key in required if key not in batch]
    if missing:
        raise UnsafeDataFileError(f"'{path}' is not a CIFAR python batch (no {', '.join(map(repr, missing))} "
                                  f"among its keys {sorted(map(str, batch))})")
    return batch
