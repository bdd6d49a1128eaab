"""CIFAR batches are read without running code from them.

The accepted files are written two ways: as Python 3 rewrites them (``conftest.make_cifar10``,
numpy 2 names, ``_codecs.encode`` for bytes) and byte for byte as the official Python 2 files
are laid out (protocol 2, ``SHORT_BINSTRING``/``BINSTRING`` strings, ``numpy.core`` names).
"""
from __future__ import annotations

import io
import os
import pickle
import struct
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import datamodules.torchvision_sets as torchvision_sets
from conftest import make_cifar10, make_cifar100
from datamodules import CIFAR10, CIFAR100
from datamodules.cifar_pickle import UnsafeDataFileError, load_cifar_batch


class Python2Pickler(pickle._Pickler):
    """Protocol 2 as Python 2's cPickle wrote CIFAR: str as BINSTRING, numpy 1 module names."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_python2_str(self, obj: str | bytes) -> None:
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        header = pickle.SHORT_BINSTRING + bytes([len(data)]) if len(data) < 256 \
            else pickle.BINSTRING + struct.pack("<i", len(data))
        self.write(header + data)
        self.memoize(obj)

    def save_numpy1_global(self, obj, name=None) -> None:  # noqa: ANN001
        module = obj.__module__.replace("numpy._core", "numpy.core")
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__name__}\n".encode())
        self.memoize(obj)

    dispatch[str] = save_python2_str
    dispatch[bytes] = save_python2_str
    dispatch[types.BuiltinFunctionType] = save_numpy1_global


def python2_pickle(obj: dict) -> bytes:
    out = io.BytesIO()
    Python2Pickler(out, protocol=2).dump(obj)
    return out.getvalue()


def test_official_python2_layout_reads_back(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(3, 3072), dtype=np.uint8)
    raw = python2_pickle({"batch_label": "training batch 1 of 5", "labels": [3, 1, 4], "data": data,
                          "filenames": ["a.png", "b.png", "c.png"]})
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in raw and b"_codecs" not in raw
    path = tmp_path / "data_batch_1"
    path.write_bytes(raw)
    batch = load_cifar_batch(path, required=("data", "labels"))
    assert np.array_equal(batch["data"], data) and batch["labels"] == [3, 1, 4]
    assert batch["filenames"] == ["a.png", "b.png", "c.png"]


def test_python3_rewritten_files_read_through_the_datamodules(tmp_path):
    written = make_cifar100(tmp_path)
    dm = CIFAR100(data_dir=str(tmp_path))
    dm.setup("fit")
    images = dm.bank_dataset.samples.images
    assert torch.equal(images, torch.from_numpy(written["train_images"]).permute(0, 3, 1, 2))


def code_running_payloads(marker: Path) -> dict[str, object]:
    class OpensAFile:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    class RunsAShellCommand:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    class ObjectArrayWithCode:  # an object array unpickles its items: they must not run either
        def __reduce__(self):
            return (np.array, ([OpensAFile()], object))

    return {"open": OpensAFile(), "os.system": RunsAShellCommand(), "object array": ObjectArrayWithCode()}


@pytest.mark.parametrize("payload", ["open", "os.system", "object array"])
def test_a_batch_that_would_run_code_is_refused_and_nothing_runs(tmp_path, payload):
    make_cifar10(tmp_path)
    marker = tmp_path / "pwned"
    evil = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    batch = {"labels": [0], "data": np.zeros((1, 3072), np.uint8), "x": code_running_payloads(marker)[payload]}
    evil.write_bytes(pickle.dumps(batch, protocol=2))
    assert not marker.exists()
    with pytest.raises(UnsafeDataFileError) as err:
        CIFAR10(data_dir=str(tmp_path)).setup("fit")
    message = str(err.value)
    assert "\n" not in message and f"'{evil}' is not a CIFAR python batch" in message
    assert "nothing in it was run" in message
    assert not marker.exists()


@pytest.mark.parametrize("content, reason", [
    (b"", "Ran out of input"),
    (None, "pickle data was truncated"),
    (pickle.dumps([1, 2, 3]), "holds a list, not a dict"),
    (pickle.dumps({"labels": [1]}), "no 'data'"),
    (pickle.dumps({"labels": [1], "data": np.zeros((1, 3072), np.float32)}), "data is float32"),
])
def test_files_that_are_not_batches_are_one_line_errors(tmp_path, content, reason):
    make_cifar10(tmp_path)
    bad = tmp_path / "cifar-10-batches-py" / "test_batch"
    if content is None:
        bad.write_bytes(bad.read_bytes()[:500])
    else:
        bad.write_bytes(content)
    with pytest.raises(UnsafeDataFileError, match=reason) as err:
        CIFAR10(data_dir=str(tmp_path)).setup("validate")
    assert "\n" not in str(err.value) and str(bad) in str(err.value)


def test_download_fetches_the_checked_archive_and_never_unpickles_with_torchvision(tmp_path, monkeypatch):
    calls = []

    def fake_download(url, download_root, filename, md5):
        calls.append((url, filename, md5))
        make_cifar10(download_root)

    monkeypatch.setattr(torchvision_sets, "download_and_extract_archive", fake_download)
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("pickle.load was called"))
    dm = CIFAR10(data_dir=str(tmp_path), download=True)
    dm.prepare_data()
    assert calls == [("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "cifar-10-python.tar.gz",
                      "c58f30108f718f92721af3b95e74349a")]
    dm.prepare_data()  # files present: nothing fetched again
    assert len(calls) == 1
    dm.setup("fit")
    assert len(dm.train_dataset) == 20
