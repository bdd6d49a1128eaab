"""No host read per training step: each family's quick config, as shipped (its
callbacks, progress bar and logging included; a smaller model), fitted for 8 and for 16 steps
inside one epoch, makes the same number of tensor-to-Python conversions, each of which is a host
sync on a GPU. Not counted: reads in the data pipeline (CPU tensors of the loader and its
transforms) and in torch's optimisers, which read their ``step`` counters, CPU tensors unless the
optimiser is fused or capturable (then on the device and never read). Reads at the logging
cadence are moved out of reach with ``log_every_n_steps``.
"""
from __future__ import annotations

import collections
import traceback

import pytest
import torch

from benchmarks.gpu_check import QUICK
from commands import lightning_cli as cli
from test_nonfinite_guard import HostReads

NOT_DEVICE_READS = ("torch/utils/data/", "torchvision/", "torch/optim/")
SMALLER = {"MAE": ["--model.network.embed_dim=32", "--model.network.depth=2", "--model.network.num_heads=2",
                   "--model.network.decoder_embed_dim=16", "--model.network.decoder_depth=1",
                   "--model.network.decoder_num_heads=2", "--data.init_args.batch_size=16"],
           "diffusion": ["--data.init_args.batch_size=16"],
           "classifier": ["--data.init_args.batch_size=16"],
           "spiral": []}


class ReadsByPlace(torch.overrides.TorchFunctionMode):
    """Counts the tensor-to-Python conversions made inside it, by where they were made, leaving
    out those that are not device reads (``NOT_DEVICE_READS``)."""

    def __init__(self) -> None:
        super().__init__()
        self.where: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func in HostReads.READS:
            frames = traceback.extract_stack()[:-1]
            if not any(part in frame.filename for frame in frames for part in NOT_DEVICE_READS):
                self.where[" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[-9:])] += 1
        return func(*args, **(kwargs or {}))


def reads_of_a_fit(family: str, steps: int, root: str) -> collections.Counter:
    args = ["fit", *QUICK[family], *SMALLER[family], f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
            "--trainer.log_every_n_steps=1000", "--trainer.accelerator=cpu", "--trainer.precision=32-true",
            f"--trainer.default_root_dir={root}"]
    with ReadsByPlace() as reads:
        cli.run_reporting_stops(args)
    return reads.where


@pytest.mark.parametrize("family", sorted(QUICK))
def test_a_training_step_reads_nothing_back(family, tmp_path):
    short, long = (reads_of_a_fit(family, steps, str(tmp_path / str(steps))) for steps in (8, 16))
    more = {where: (short[where], long[where]) for where in long if long[where] != short[where]}
    assert not more, f"host reads that grow with the steps (8 steps, 16 steps): {more}"
