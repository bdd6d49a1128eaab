"""Training images read from object storage: one epoch of the ImageNet train dataset (the MAE train
transform at 224 px, one process, one thread) from a conversion in an S3 server, from the same
conversion on local disk and from the ImageFolder of the same JPEGs; and what the epoch fetched
from the server: bytes against the conversion's size and requests against its chunks.

The server is moto's S3 over HTTPS on this machine (:mod:`benchmarks.s3_server`): the rows measure
the package's and litdata's reading, not a network. Each round reads from a fresh cache, in the
chunk-by-chunk order a fit from object storage uses (:class:`datamodules.chunk_order.ChunkOrder`).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

from commands import chunks
from datamodules.imagenet import ImageNet

from .data_pipeline import write_jpeg_folder
from .s3_server import S3Server
from .settings import Settings
from .timing import Row, ratio_row

SECTION = "data from object storage (an S3 server on this machine)"


def epoch_rate(data: ImageNet) -> float:
    """Images per second of one epoch of ``data``'s train loader (its order, no workers)."""
    data.setup("fit")
    loader = data.train_dataloader()
    start, images = time.perf_counter(), 0
    for batch, _ in loader:
        images += len(batch)
    return images / (time.perf_counter() - start)


def run(settings: Settings) -> list[Row]:
    per_class = settings.pick(40, 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        server = S3Server(Path(root)).start()
        before = dict(os.environ)
        try:
            os.environ.update(server.environment())
            server.client().create_bucket(Bucket="bench")
            write_jpeg_folder(root, per_class, names=[f"n{i}" for i in range(4)])
            local = os.path.join(root, "chunks")
            chunks.main([root, local, "--num_workers", "1", "--no_progress", "--chunk_bytes", "1MB"])
            client = server.client()
            for path in Path(local).rglob("*"):  # the conversion copied up, as `aws s3 sync` would
                if path.is_file():
                    client.upload_file(str(path), "bench", f"chunks/{path.relative_to(local).as_posix()}")
            index = json.loads(Path(local, "train", "index.json").read_text())
            size, count = sum(c["chunk_bytes"] for c in index["chunks"]), len(index["chunks"])
            options = dict(num_classes=4, batch_size=16, image_size=224, num_workers=0, drop_last_train=False)
            rates: dict[str, list[float]] = {"s3": [], "chunks": [], "folder": []}
            fetched: list[tuple[int, int]] = []
            for round_ in range(settings.rounds):
                server.served.reset()
                rates["s3"].append(epoch_rate(ImageNet(data_dir="s3://bench/chunks", **options,
                                                       cache_dir=os.path.join(root, f"cache{round_}"))))
                gets = server.served.gets("/bench/chunks/train/chunk-")
                fetched.append((sum(n for _, n in gets), len(gets)))
                rates["chunks"].append(epoch_rate(ImageNet(data_dir=local, **options, train_order="chunks")))
                rates["folder"].append(epoch_rate(ImageNet(data_dir=root, **options)))
        finally:
            os.environ.clear()
            os.environ.update(before)
            server.stop()
            torch.set_num_threads(threads)
    images = 4 * per_class
    return [
        ratio_row(SECTION, "images/s from the S3 server / from the ImageFolder",
                  [a / b for a, b in zip(rates["s3"], rates["folder"])], None,
                  f"one epoch of {images} JPEGs, 224 px MAE train transform, one process; from a fresh cache, "
                  "chunk by chunk"),
        ratio_row(SECTION, "images/s from local chunks / from the ImageFolder",
                  [a / b for a, b in zip(rates["chunks"], rates["folder"])], None, "the same JPEGs and transform"),
        ratio_row(SECTION, "images/s per worker from the S3 server", rates["s3"], None,
                  "its cache emptied before each epoch", unit="img/s"),
        ratio_row(SECTION, "bytes fetched in an epoch / the conversion's train chunks",
                  [b / size for b, _ in fetched], "<= 1.10", f"{size / 2**20:.1f} MiB in {count} chunks"),
        ratio_row(SECTION, "requests for chunks in an epoch / the conversion's train chunks",
                  [r / count for _, r in fetched], "<= 1.00", f"{count} chunks of {images} images"),
    ]
