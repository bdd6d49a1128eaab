"""Training from a conversion (shortcutlab chunks) at 1 and 2 processes: every epoch visits every
training sample exactly once across the ranks, in an order that changes each epoch; the batches
are the ImageFolder's; and a fit stopped mid-epoch resumes with exactly the batches the
uninterrupted fit handed out after its checkpoint (as the file loader does)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from commands import chunks
from conftest import IMAGENET_TEST_CLASSES, make_imagefolder
from helpers import folders

REPO = Path(__file__).resolve().parents[2]
# a fit of 2 epochs that records every batch's samples (each image's pixel sum names it), saving a
# checkpoint after optimiser step SAVE_AT; then, with "resume", the fit resumed from it
SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    from pathlib import Path
    sys.path[:0] = {tests!r}
    warnings.filterwarnings("ignore")
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
    from callbacks.reliability.exact_resume import ExactResume
    from datamodules.imagenet import ImageNet

    SAVE_AT = 7

    class Recorder(LightningModule):
        def __init__(self):
            super().__init__()
            self.layer, self.seen = torch.nn.Linear(1, 1), []

        def training_step(self, batch, batch_idx):
            images, _ = batch
            self.seen.append([self.current_epoch, batch_idx, images.flatten(1).double().sum(1).tolist()])
            return self.layer(images.mean(dim=(1, 2, 3)).unsqueeze(1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class SaveAt(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == SAVE_AT:
                trainer.save_checkpoint(Path(sys.argv[2]) / "step.ckpt")

    def fit(data_dir, out, devices, ckpt_path=None):
        seed_everything(0)
        model = Recorder()
        data = ImageNet(data_dir=data_dir, num_classes=4, batch_size=2, image_size=8, num_workers=0,
                        cache_dir=os.environ.get("TEST_CHUNK_CACHE"),
                        train_augmentation=False, persistent_workers=False)
        trainer = Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                          max_epochs=2, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[ExactResume()] + ([SaveAt()] if ckpt_path is None else []), default_root_dir=out)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        if ckpt_path is None and trainer.global_rank == 0:
            data.setup("fit")
            bank = [data.bank_dataset[i][0].double().sum().item() for i in range(len(data.bank_dataset))]
            (Path(out) / "bank.json").write_text(json.dumps(bank))
        name = "resumed" if ckpt_path else "full"
        (Path(out) / f"{{name}}{{trainer.global_rank}}.json").write_text(json.dumps(model.seen))
        return trainer

    data_dir, out, devices = sys.argv[1], sys.argv[2], int(sys.argv[3])
    fit(data_dir, out, devices)
    fit(data_dir, out, devices, ckpt_path=str(Path(out) / "step.ckpt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
""")


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trees")
    make_imagefolder(root / "folder", IMAGENET_TEST_CLASSES, n_per_class=5)
    chunks.main([str(root / "folder"), str(root / "chunks"), "--num_workers", "1", "--chunk_bytes", "16KB",
                 "--no_progress"])
    return {"folder": root / "folder", "chunks": root / "chunks"}


def run(script: Path, data_dir: Path, out: Path, devices: int, warm: list[str]) -> None:
    from helpers.fork_server import torchrun_workers
    from test_callbacks_ddp import free_port

    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(script), str(data_dir), str(out), str(devices)]
    if devices > 1:
        cmd = torchrun_workers([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(devices),
                                "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *cmd[1:]], warm)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the fit timed out")
    assert proc.returncode == 0, output[-5000:]


def batches(out: Path, name: str, devices: int) -> list[list]:
    """``[epoch, batch, rank, sample ids]`` of every batch of every rank."""
    return sorted([epoch, batch, rank, ids] for rank in range(devices)
                  for epoch, batch, ids in json.loads((out / f"{name}{rank}.json").read_text()))


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_every_sample_once_an_epoch_and_a_mid_epoch_resume_continues_exactly(trees, tmp_path, devices,
                                                                             warm_shortcutlab):
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT.format(tests=folders.PATHS))
    run(script, trees["chunks"], tmp_path / "chunks", devices, warm_shortcutlab)
    full = batches(tmp_path / "chunks", "full", devices)
    everything = sorted(json.loads((tmp_path / "chunks" / "bank.json").read_text()))
    assert len(everything) == 20 == len(set(everything))  # the pixel sums name the samples
    orders = []
    for epoch in (0, 1):
        seen = [i for e, _, _, ids in full if e == epoch for i in ids]
        assert sorted(seen) == everything, epoch  # each sample once, across the ranks
        orders.append(seen)
    assert orders[0] != orders[1]  # the order changes with the epoch
    steps_per_epoch = 20 // (2 * devices)
    saved = (7 // steps_per_epoch, 7 % steps_per_epoch)  # the batch after the checkpoint: mid-epoch
    assert saved[1] != 0
    after = [b for b in full if (b[0], b[1]) >= saved]
    assert batches(tmp_path / "chunks", "resumed", devices) == after
    if devices == 1:  # the ImageFolder itself gives the same batches
        run(script, trees["folder"], tmp_path / "folder", devices, warm_shortcutlab)
        assert batches(tmp_path / "folder", "full", devices) == full
