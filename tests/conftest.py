"""Shared test fixtures: small datasets written in the real on-disk formats.

The ``make_*`` functions write a tiny dataset under ``root`` exactly where and how the real
one lies (so ``data_dir=root`` works for the datamodules and for torchvision itself) and return
the pixels and labels they wrote, for comparisons. ``data_root`` is one session-wide folder
holding all of them, for tests (configs, CLI) that only need the data to be there.
"""
from __future__ import annotations

import os
import pickle
import struct
import sys
from pathlib import Path

# the suite runs in the reproducible CPU mode (commands/reproducible_cpu.py), one thread a process as
# before: its exact values hold on any x86-64 machine, and the quickstart configs ask for the mode
assert "torch" not in sys.modules, "the reproducible CPU mode must be set before torch loads"
os.environ.setdefault("SHORTCUTLAB_REPRODUCIBLE_THREADS", "1")
from commands import reproducible_cpu  # noqa: E402 (imports no torch)

reproducible_cpu.enable()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from helpers import folders  # noqa: E402

sys.path[:0] = [p for p in folders.PATHS if p not in sys.path]  # test modules import each other by name
# the processes the tests start import no wandb (helpers/without_wandb/wandb.py says why); this process does
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), folders.WITHOUT_WANDB]))

reproducible_cpu.finish()  # one thread (the workers share the cores), oneDNN off

# The slowest test files (seconds on a 2-core machine), collected first: under ``--dist loadfile
# --no-loadscope-reorder`` each file is one unit of work handed to the next free worker in this
# order, so the two workers take the long files early and end together (ordered by their number
# of tests, as xdist does by default, the few long ones came last and one worker ran them alone).
SLOWEST_FIRST = ["test_docs.py", "commands/test_slurm_requeue.py", "test_examples.py", "commands/test_sweep_signals.py",
                 "configs/test_configs.py", "commands/test_slurm_job.py", "callbacks/test_lost_rank.py",
                 "callbacks/test_compile.py", "lightning_mods/test_disk_faults.py", "callbacks/test_preemption.py",
                 "lightning_mods/test_distributed_evaluation.py", "commands/test_imagenet_commands.py",
                 "callbacks/test_multinode.py", "callbacks/test_nonfinite_guard.py", "callbacks/test_callbacks_ddp.py",
                 "commands/test_cli.py", "commands/test_sweep_loggers.py", "datamodules/test_streamed_s3.py"]


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 (pytest's)
    order = {name: rank for rank, name in enumerate(SLOWEST_FIRST)}
    tests = Path(__file__).resolve().parent

    def rank(item) -> int:  # noqa: ANN001
        return order.get(Path(str(item.fspath)).resolve().relative_to(tests).as_posix(), len(order))
    items.sort(key=rank)  # stable: the other files, and the tests inside each, keep their order


CIFAR10_BATCH_NAMES = [f"data_batch_{i}" for i in range(1, 6)]
MNIST_RAW_NAMES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                   "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
IMAGENET_TEST_CLASSES = ["n01440764", "n01443537", "n01484850", "n01491361"]
IMAGENET_TEST_SUBSET = ["n01484850", "n01440764"]  # not in sorted order on purpose


def random_images(rng: np.random.Generator, n: int, height: int, width: int, channels: int | None) -> np.ndarray:
    shape = (n, height, width) if channels is None else (n, height, width, channels)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def cifar_rows(images_hwc: np.ndarray) -> np.ndarray:
    """``N x 32 x 32 x 3`` images -> CIFAR rows: 1024 red, then 1024 green, then 1024 blue bytes."""
    return np.ascontiguousarray(images_hwc.transpose(0, 3, 1, 2).reshape(len(images_hwc), 3072))


def write_pickle(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def make_cifar10(root: str | os.PathLike, n_per_batch: int = 4, n_test: int = 6, seed: int = 0) -> dict:
    """``root/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}``.

    Returns ``train_images`` / ``test_images`` (N x 32 x 32 x 3 uint8, HWC) and
    ``train_labels`` / ``test_labels`` (int64), in file order.
    """
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    train_images, train_labels = [], []
    for name in CIFAR10_BATCH_NAMES:
        images = random_images(rng, n_per_batch, 32, 32, 3)
        labels = rng.integers(0, 10, size=n_per_batch).tolist()
        write_pickle(folder / name, {"batch_label": f"training batch of {name}", "labels": labels,
                                     "data": cifar_rows(images),
                                     "filenames": [f"img_{name}_{i}.png" for i in range(n_per_batch)]})
        train_images.append(images)
        train_labels += labels
    test_images = random_images(rng, n_test, 32, 32, 3)
    test_labels = rng.integers(0, 10, size=n_test).tolist()
    write_pickle(folder / "test_batch", {"batch_label": "testing batch 1 of 1", "labels": test_labels,
                                         "data": cifar_rows(test_images),
                                         "filenames": [f"test_{i}.png" for i in range(n_test)]})
    write_pickle(folder / "batches.meta", {"num_cases_per_batch": n_per_batch, "num_vis": 3072,
                                           "label_names": ["airplane", "automobile", "bird", "cat", "deer",
                                                           "dog", "frog", "horse", "ship", "truck"]})
    return {"train_images": np.concatenate(train_images), "train_labels": np.array(train_labels, dtype=np.int64),
            "test_images": test_images, "test_labels": np.array(test_labels, dtype=np.int64)}


def make_cifar100(root: str | os.PathLike, n_train: int = 12, n_test: int = 6, seed: int = 1) -> dict:
    """``root/cifar-100-python/{train, test, meta}``; returns the pixels and fine labels as ``make_cifar10``."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = random_images(rng, n, 32, 32, 3)
        fine = rng.integers(0, 100, size=n)
        write_pickle(folder / split, {"batch_label": f"{split}ing batch 1 of 1", "fine_labels": fine.tolist(),
                                      "coarse_labels": (fine // 5).tolist(), "data": cifar_rows(images),
                                      "filenames": [f"{split}_{i}.png" for i in range(n)]})
        written[f"{split}_images"], written[f"{split}_labels"] = images, fine.astype(np.int64)
    write_pickle(folder / "meta", {"fine_label_names": [f"fine_{i}" for i in range(100)],
                                   "coarse_label_names": [f"coarse_{i}" for i in range(20)]})
    return written


def make_mnist(root: str | os.PathLike, n_train: int = 12, n_test: int = 6, seed: int = 2) -> dict:
    """``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (uncompressed idx).

    Returns ``train_images`` / ``test_images`` (N x 28 x 28 uint8) and int64 labels.
    """
    rng = np.random.default_rng(seed)
    folder = Path(root) / "MNIST" / "raw"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = random_images(rng, n, 28, 28, None)
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        image_name, label_name = MNIST_RAW_NAMES[split]
        # idx: big-endian magic (0x0803 images / 0x0801 labels), the sizes, then the bytes.
        (folder / image_name).write_bytes(struct.pack(">4i", 2051, n, 28, 28) + images.tobytes())
        (folder / label_name).write_bytes(struct.pack(">2i", 2049, n) + labels.tobytes())
        written[f"{split}_images"], written[f"{split}_labels"] = images, labels.astype(np.int64)
    return written


def make_imagefolder(root: str | os.PathLike, classes: list[str], n_per_class: int = 2,
                     size: tuple[int, int] = (20, 24), splits: tuple[str, ...] = ("train", "val"),
                     seed: int = 3) -> dict:
    """``root/<split>/<class>/<class>_<i>.{png,JPEG}`` RGB images of ``size`` (height, width).

    Image 0 of every class is a PNG (lossless), the others JPEG. Returns
    ``{split: [(path, class, pixels H x W x 3 uint8), ...]}`` in the order written.
    """
    rng = np.random.default_rng(seed)
    written: dict[str, list] = {}
    for split in splits:
        written[split] = []
        for name in classes:
            folder = Path(root) / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n_per_class):
                pixels = rng.integers(0, 256, size=(*size, 3), dtype=np.uint8)
                path = folder / (f"{name}_{i}.png" if i == 0 else f"{name}_{i}.JPEG")
                Image.fromarray(pixels).save(path)
                written[split].append((path, name, pixels))
    return written


def make_class_list(path: str | os.PathLike, classes: list[str]) -> Path:
    """A class-list file: one class name per line."""
    path = Path(path)
    path.write_text("\n".join(classes) + "\n")
    return path


@pytest.fixture(scope="session", autouse=True)
def _the_command_line_of_a_cli_called_from_python():
    """``cli.main(args)`` as a user's script calls it: LightningCLI warns when it gets ``args`` while
    ``sys.argv`` holds arguments too (here pytest's own)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", sys.argv[:1])
        yield


@pytest.fixture(scope="session")
def warm_shortcutlab() -> list[str]:
    """The command line of ``shortcutlab`` through a warm fork of the CLI (helpers/fork_server.py),
    one server per test process: a command starts in well under a second instead of the 8 s a new
    interpreter takes to import torch and Lightning, and passes on the signals it is sent. The
    server has the checkout alone on ``PYTHONPATH``, as a user's shell; a command adds its own."""
    from helpers.fork_server import ForkServer

    with ForkServer(dict(os.environ, PYTHONPATH=str(folders.REPO))) as server:
        yield server.argv()


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> dict[str, Path]:
    """One folder with every generated dataset; the paths to point the datamodules at.

    ``root`` (CIFAR-10, CIFAR-100 and MNIST: their ``data_dir``), ``imagenet`` (train/val class
    folders of ``IMAGENET_TEST_CLASSES``) and ``imagenet_class_list`` (``IMAGENET_TEST_SUBSET``).
    """
    root = tmp_path_factory.mktemp("data")
    make_cifar10(root)
    make_cifar100(root)
    make_mnist(root)
    make_imagefolder(root / "imagenet", IMAGENET_TEST_CLASSES)
    class_list = make_class_list(root / "imagenet_subset.txt", IMAGENET_TEST_SUBSET)
    return {"root": root, "imagenet": root / "imagenet", "imagenet_class_list": class_list}


@pytest.fixture
def data_roots(data_root):
    """``overrides(data_class_path, config_data_init_args) -> list of CLI overrides`` pointing a
    config's datamodule at the generated files, with a tiny batch."""

    def overrides(class_path: str, init_args: dict) -> list[str]:
        name = class_path.rsplit(".", 1)[-1]
        args = []
        if "batch_size" in init_args or name in ("Digits", "CIFAR10", "CIFAR100", "MNIST", "ImageNet"):
            args.append("--data.init_args.batch_size=4")
        if name in ("CIFAR10", "CIFAR100", "MNIST"):
            args += [f"--data.init_args.data_dir={data_root['root']}", "--data.init_args.download=false"]
        elif name == "ImageNet":
            args.append(f"--data.init_args.data_dir={data_root['imagenet']}")
            if init_args.get("class_list"):
                args.append(f"--data.init_args.class_list={data_root['imagenet_class_list']}")
            else:
                args.append(f"--data.init_args.num_classes={len(IMAGENET_TEST_CLASSES)}")
        if "num_workers" in init_args:
            args.append("--data.init_args.num_workers=0")
        return args

    return overrides


@pytest.fixture(autouse=True)
def _signals_handled_again_after_a_preemption_test():
    """A pre-emption stop in this process ignores SIGTERM until exit (callbacks/reliability/preemption.py);
    the next test gets the handlers back."""
    yield
    from callbacks.reliability.preemption import restore_stop_signals

    restore_stop_signals()

