"""Two-process DDP (gloo, CPU) run of a tiny MAE with the online probe, kNN and effective-rank
callbacks: it completes, every rank logs the same values and holds the same probe head, and
kNN accuracy, effective rank and probe accuracy equal one process's on the same weights.

The DDP run is a script launched with ``python -m torch.distributed.run`` (a real multi-process
launch, as on a cluster); it writes what each rank saw as JSON. The single-process reference
runs ``validate`` in the test process on the weights the DDP run ended with.
"""
from __future__ import annotations

from helpers import folders

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningDataModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from callbacks.measurement.effective_rank import EffectiveRank
from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.online_probe import DepthHeads, LinearHeads, OnlineLinearProbe
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
COMPARED = ("knn/top1", "knn/top5", "rank/entropy", "rank/effective_rank", "online_probe/val_top1")


def make_model():
    """A tiny MAE with decayed shortcuts and U-Net skips (1 x 8 x 8 images, 4 patches)."""
    from lightning_mods.mae import MaskedAutoencoder

    return MaskedAutoencoder(MaskedAutoencoderViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2), base_lr=1e-3, warmup_epochs=0.5, num_reconstructions=2)


def make_callbacks() -> list:
    return [OnlineLinearProbe(heads=LinearHeads(lr=1e-2), every_n_steps=2, max_samples=3, depth=DepthHeads("all")),
            KNNEvaluator(k=5),
            EffectiveRank(per_block=True)]


def class_images(n: int, num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` 1 x 8 x 8 images: a fixed pattern per class plus noise."""
    patterns = torch.randn(num_classes, 1, 8, 8, generator=torch.Generator().manual_seed(99))
    labels = torch.arange(n) % num_classes
    noise = torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))
    return patterns[labels] + 0.7 * noise, labels


class ImageData(LightningDataModule):
    """Odd-sized bank (37) and validation (23) sets: a DistributedSampler would pad both."""

    num_classes = 6

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, 0
        self.train_dataset = self.bank_dataset = TensorDataset(*class_images(37, self.num_classes, 0))
        self.val_dataset = TensorDataset(*class_images(23, self.num_classes, 1))

    def train_dataloader(self):
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_dataset, batch_size=self.batch_size)


SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    from pathlib import Path
    import torch
    sys.path[:0] = {tests!r}
    warnings.filterwarnings("ignore")
    from lightning.pytorch import Trainer, seed_everything
    from test_callbacks_ddp import ImageData, make_callbacks, make_model, COMPARED

    out = Path(sys.argv[1])
    seed_everything(0)
    model, callbacks = make_model(), make_callbacks()
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, limit_train_batches=2,
                      callbacks=callbacks, default_root_dir=out, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1)
    trainer.fit(model, datamodule=ImageData())
    probe = callbacks[0]
    seen = {{
        "world_size": trainer.world_size,
        "metrics": {{k: float(trainer.callback_metrics[k]) for k in COMPARED if k in trainer.callback_metrics}},
        "probe_steps": probe.steps,
        "rank_profile": callbacks[2].last_profile["effective_rank"],
        "probe_head": {{k: v.tolist() for k, v in probe.head.state_dict().items()}},
        "block_heads": {{str(b): {{k: v.tolist() for k, v in heads[0].state_dict().items()}}
                        for b, heads in probe.probe_heads.block_heads.items()}},
    }}
    (out / f"rank{{trainer.global_rank}}.json").write_text(json.dumps(seen))
    if trainer.is_global_zero:
        torch.save({{"model": model.state_dict(), "probe": probe.state_dict()}}, out / "final.pt")
    # predict: each rank writes its part, rank 0 merges them (23 samples, padded to 24 by the sampler)
    from callbacks.reporting.prediction_writer import PredictionWriter
    predictor = Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[PredictionWriter(str(out / "predictions.pt"))])
    predictor.predict(model, dataloaders=ImageData().val_dataloader(), return_predictions=False)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_to_end(cmd: list[str], env: dict, timeout: float) -> str:
    """Run a launcher (torchrun and its workers) in its own session, to the end: on a timeout the
    launcher and every worker are killed together, none left behind. Its output; fails the test
    on a timeout or a non-zero exit."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail("the DDP run timed out (a collective that not every rank joined?):\n" + output[-5000:])
    assert proc.returncode == 0, output[-6000:]
    return output


def ranks_seen(script: Path, out: Path, devices: int, args: list[str], shortcutlab: list[str], env: dict) -> list[dict]:
    """Run ``script OUT ARGS...`` on ``devices`` torchrun workers (warm forks of ``shortcutlab``,
    helpers/fork_server.py) to the end, and read the ``rank<r>.json`` each rank wrote into ``out``."""
    from helpers.fork_server import torchrun_workers

    out.mkdir(parents=True, exist_ok=True)
    run_to_end(torchrun_workers([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
                                 str(devices), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                                 str(script), str(out), *args], shortcutlab), env, timeout=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(tmp_path, warm_shortcutlab):
    from helpers.fork_server import torchrun_workers

    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT.format(tests=folders.PATHS))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), str(tmp_path)]
    run_to_end(torchrun_workers(cmd, warm_shortcutlab), env, timeout=180)  # workers: warm forks (fork_server.py)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world_size"] == 2
    assert set(ranks[0]["metrics"]) == set(COMPARED)
    # every rank logged the same values and holds the same probe head
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    assert len(ranks[0]["rank_profile"]) == 2 and ranks[0]["rank_profile"] == ranks[1]["rank_profile"]
    assert ranks[0]["probe_head"] == ranks[1]["probe_head"]
    # the per-block heads, stepped together (callbacks/measurement/online_probe/_stacked_heads.py), alike on every rank too
    assert sorted(ranks[0]["block_heads"]) == ["1", "2"] and ranks[0]["block_heads"] == ranks[1]["block_heads"]
    assert ranks[0]["probe_steps"] == ranks[1]["probe_steps"] == 2  # batches 0 and 2 of 4

    # one process, the same final weights and probe head
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    model = make_model()
    model.load_state_dict(final["model"])
    callbacks = make_callbacks()
    callbacks[0].load_state_dict(final["probe"])
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=callbacks, default_root_dir=tmp_path / "single")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.validate(model, datamodule=ImageData(), verbose=False)
    single = {k: float(trainer.callback_metrics[k]) for k in COMPARED}
    predictions = torch.load(tmp_path / "predictions.pt", weights_only=True)
    images, labels = ImageData().val_dataset.tensors
    assert torch.equal(predictions["indices"], torch.arange(23)) and torch.equal(predictions["labels"], labels)
    with torch.no_grad():
        torch.testing.assert_close(predictions["embeddings"], model.eval().forward_features(images))
    assert sorted(p.name for p in tmp_path.glob("predictions*")) == ["predictions.pt"]  # the parts are merged
    ddp = ranks[0]["metrics"]
    for name in ("knn/top1", "knn/top5", "online_probe/val_top1"):
        assert ddp[name] == single[name], name  # counts of the same 23 queries: exact
    for name in COMPARED:
        assert ddp[name] == pytest.approx(single[name], rel=1e-5), name
    assert ranks[0]["rank_profile"] == pytest.approx(callbacks[2].last_profile["effective_rank"], rel=1e-5)
