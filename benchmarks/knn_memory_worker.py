"""One rank of the kNN memory figure (:mod:`benchmarks.knn_at_scale`), launched with torchrun:
``KNNEvaluator(blocks="all")`` in a ``Trainer.validate`` over a synthetic bank (13 banks of 768
features: a fixed sine of the image index per block), writing how much this rank's resident
memory grew at its peak over the validation.

    python -m torch.distributed.run --nproc_per_node 2 -m benchmarks.knn_memory_worker OUT IMAGES SCORING_MIB
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.knn_bank import bank_bytes

WIDTH, BLOCKS, QUERIES, CLASSES, BATCH = 768, 12, 500, 100, 128


class SyntheticBlocks(LightningModule):
    """Block ``b`` of image ``i``: ``sin(i * f + phase_b)``; the features: twice the last block."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("freq", torch.rand(WIDTH, generator=g))
        self.register_buffer("phase", torch.rand(BLOCKS, WIDTH, generator=g) * 6.28)

    def forward_intermediates(self, x, indices=None, intermediates_only=False):  # noqa: ANN001, ANN201
        blocks = [torch.sin(x * self.freq + phase) for phase in self.phase]
        return blocks if intermediates_only else (2 * blocks[-1], blocks)

    def forward_features(self, x):  # noqa: ANN001, ANN201
        return self.forward_intermediates(x)[0]

    def validation_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        return None


class SyntheticData(LightningDataModule):
    num_classes = CLASSES

    def __init__(self, images: int) -> None:
        super().__init__()
        self.batch_size, self.num_workers = BATCH, 0
        index = torch.arange(images, dtype=torch.float32).view(-1, 1)
        self.bank_dataset = TensorDataset(index, torch.arange(images) % CLASSES)
        self.val_dataset = TensorDataset(index[:QUERIES] + 0.5, torch.arange(QUERIES) % CLASSES)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_dataset, batch_size=self.batch_size)


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory(Callback):
    """Resets the peak resident size at the validation's start (once the process group is set up)
    and reads it at its end."""

    def on_validation_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        if torch.distributed.is_initialized():  # the process group's first collectives set up its buffers
            torch.distributed.all_gather(
                [torch.zeros(64) for _ in range(torch.distributed.get_world_size())], torch.zeros(64))
            torch.distributed.barrier()
        Path("/proc/self/clear_refs").write_text("5")
        self.before = status_kib("VmRSS")

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.grown = (status_kib("VmHWM") - self.before) * 1024


def main() -> None:
    warnings.filterwarnings("ignore")
    out, images, scoring_mib = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    peak = PeakMemory()
    trainer = Trainer(accelerator="cpu", devices=int(__import__("os").environ.get("WORLD_SIZE", 1)), strategy="ddp",
                      logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      callbacks=[peak, KNNEvaluator(k=20, blocks="all", bank_dtype="float32", scoring_mib=scoring_mib)])
    trainer.validate(SyntheticBlocks(), datamodule=SyntheticData(images), verbose=False)
    record = {"grown": peak.grown, "bank_bytes": bank_bytes(images, [WIDTH] * (BLOCKS + 1), torch.float32),
              "queries_bytes": QUERIES * (BLOCKS + 1) * WIDTH * 4, "scoring_bytes": scoring_mib * 2 ** 20}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
