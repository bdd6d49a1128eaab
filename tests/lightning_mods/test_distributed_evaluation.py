"""Distributed evaluation counts each image once: under DDP with 2 and 3 processes on the CPU,
every validation metric of the classifier, the LinearProbe (its per-block heads too) and the
spiral classifier, and the MAE's and the diffusion model's validation losses (their masks and
noise drawn per image, from its dataset index), equals the one-process value on a validation set
of 37 samples (not a multiple of the world size, nor of the batch of 5), and those losses count
exactly the 37 images. Lightning's DistributedSampler repeats samples
to even out the ranks; the modules leave the repeats out (lightning_mods/evaluation/_distributed_eval.py)."""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from helpers import folders
from test_callbacks_ddp import free_port, run_to_end

SCRIPT = textwrap.dedent('''
    import json, os, sys, warnings
    from pathlib import Path
    import torch
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_mods.backbone.resnet import ResNet18Cifar
    from lightning_mods.classifier import ImageClassifier
    from lightning_mods.backbone.uvit import UViT
    from lightning_mods.diffusion import DiffusionModule
    from lightning_mods.linear_probe import LinearProbe
    from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
    from lightning_mods.mae import MaskedAutoencoder
    from lightning_mods.backbone.residual_mlp import ResidualMLP
    from lightning_mods.spiral_classifier import SpiralClassifier

    out, world = Path(sys.argv[1]), int(sys.argv[2])
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(37, 1, 8, 8, generator=generator), torch.arange(37) % 3
    points, sides = torch.randn(37, 2, generator=generator), torch.arange(37) % 2

    def loader(*tensors):
        return DataLoader(TensorDataset(*tensors), batch_size=5)

    def counting(cls):
        class Counting(cls):
            counted = 0

            def without_repeats(self, batch_idx, *tensors, **kwargs):
                found = super().without_repeats(batch_idx, *tensors, **kwargs)
                self.counted += found[0]
                return found
        return Counting

    torch.manual_seed(1)
    # pixel targets (not normalised per patch, where an untrained decoder's loss barely depends on
    # which patches are masked): the loss moves with each image's mask
    mae = counting(MaskedAutoencoder)(MaskedAutoencoderViT(
        img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=8,
        decoder_depth=1, decoder_num_heads=2, norm_pix_loss=False))
    torch.manual_seed(2)
    runs = {
        "classifier": (ImageClassifier(ResNet18Cifar(), num_classes=3, in_chans=1), loader(images, labels)),
        "probe": (LinearProbe(backbone=MaskedAutoencoder(MaskedAutoencoderViT(
                      img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=8,
                      decoder_depth=1, decoder_num_heads=2)), num_classes=3, blocks="all"),
                  loader(images, labels)),
        "spiral": (SpiralClassifier(ResidualMLP(depth=2, width=4)), loader(points, sides)),
        "mae": (mae, loader(images, labels)),
        "diffusion": (counting(DiffusionModule)(UViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=3,
                                                    num_heads=2, shortcut={"kind": "linear", "alpha_min": 0.7},
                                                    zero_init_branches=True),
                                               pixel_mean=[0.5], pixel_std=[0.5], num_sample_images=0),
                      loader(images, labels)),
    }
    results = {}
    for name, (model, data) in runs.items():
        trainer = Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", logger=False,
                          enable_progress_bar=False, enable_model_summary=False, default_root_dir=out / name)
        results[name] = trainer.validate(model, dataloaders=data, verbose=False)[0]
        if name == "probe":
            results["probe blocks"] = {str(r["block"]): r["val/top1"] for r in model.over_depth.validate_rows}
        if hasattr(model, "counted"):
            counted = torch.tensor([model.counted])
            if dist.is_initialized():
                dist.all_reduce(counted)
            results[name]["images counted"] = int(counted)
    if int(os.environ.get("RANK", 0)) == 0:
        (out / f"world{world}.json").write_text(json.dumps(results))
    if dist.is_initialized():  # every rank leaves together (gloo's threads abort a process that exits alone)
        dist.barrier()
        dist.destroy_process_group()
''')


def test_sample_indices_are_the_dataset_indices_a_distributed_sampler_hands_out():
    # 7 samples over 3 ranks: the sampler pads its list to [0..6, 0, 1]; rank 1 gets 1, 4 and 0
    # (a repeat), in batches of 2; without a DistributedSampler the positions are the indices
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_mods.evaluation._distributed_eval import ExactEvaluation

    import torch

    data = TensorDataset(torch.arange(7))
    module = ExactEvaluation()
    module._trainer = SimpleNamespace(testing=False, val_dataloaders=DataLoader(
        data, batch_size=2, sampler=DistributedSampler(data, num_replicas=3, rank=1, shuffle=False)))
    assert module.sample_indices(2, 0).tolist() == [1, 4]
    assert module.sample_indices(1, 1).tolist() == [0]
    assert module.real_samples(1, 1).tolist() == [False]  # the same batch asked again: the repeat
    module = ExactEvaluation()
    module._trainer = SimpleNamespace(testing=False, val_dataloaders=DataLoader(data, batch_size=3))
    assert [module.sample_indices(3, 0).tolist(), module.sample_indices(3, 1).tolist()] == [[0, 1, 2], [3, 4, 5]]


def run(tmp_path, world: int, warm: list[str]) -> dict:
    """The script in one process, or under torchrun; warm forks of the CLI's process
    (tests/helpers/fork_server.py) run it."""
    from helpers.fork_server import torchrun_workers

    script = tmp_path / "evaluate.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=folders.PYTHONPATH, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [*warm[:-1], "python", str(script), str(tmp_path), "1"] if world == 1 else torchrun_workers(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world),
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), str(tmp_path), str(world)], warm)
    run_to_end(cmd, env, timeout=240)
    return json.loads((tmp_path / f"world{world}.json").read_text())


@pytest.mark.slow
def test_two_processes_report_the_one_process_metrics(tmp_path, warm_shortcutlab):
    """37 samples over 2 ranks: one repeated sample left out (three ranks' strides and repeats:
    the index test above)."""
    one = run(tmp_path, 1, warm_shortcutlab)
    assert one["mae"]["images counted"] == one["diffusion"]["images counted"] == 37
    assert set(one["probe blocks"]) == {"1", "2"}
    for world in (2,):
        many = run(tmp_path, world, warm_shortcutlab)
        for name in ("classifier", "probe", "spiral", "mae", "diffusion"):
            assert set(many[name]) == set(one[name]), name
            for metric, value in one[name].items():
                assert many[name][metric] == pytest.approx(value, rel=1e-6, abs=1e-7), (world, name, metric)
        assert many["probe blocks"] == pytest.approx(one["probe blocks"], rel=1e-6), world
        assert many["mae"]["images counted"] == many["diffusion"]["images counted"] == 37, world
