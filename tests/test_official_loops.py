"""benchmarks/official_loops.py: the papers' own training loops run on small generated data of
the real on-disk formats (a JPEG class-folder tree, CIFAR-100 pickles) around this package's
networks, train them (weights move, losses finite), read the loss to the host as often as the
official code does, and feed the augmentation the papers name."""
from __future__ import annotations

import pytest
import torch
from torchvision import transforms

from benchmarks import official_loops
from benchmarks.data_pipeline import write_jpeg_folder
from benchmarks.gpu_check import write_cifar100
from benchmarks.settings import Settings
from lightning_mods.diffusion import DiffusionModule
from lightning_mods.mae import MaskedAutoencoder
from test_host_reads import ReadsByPlace
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.backbone.uvit import UViT


def weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def test_mae_loop_trains_on_an_image_folder_with_maes_augmentation(tmp_path):
    write_jpeg_folder(str(tmp_path), per_class=4)
    loader = official_loops.mae_loader(tmp_path / "train", 32, 4, 0)
    crop = loader.dataset.transform.transforms[0]
    assert isinstance(crop, transforms.RandomResizedCrop)
    assert crop.scale == (0.2, 1.0) and crop.interpolation == transforms.InterpolationMode.BICUBIC
    assert loader.drop_last and loader.pin_memory
    torch.manual_seed(0)
    model = MaskedAutoencoder(MaskedAutoencoderViT(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2), num_reconstructions=0)
    before = weights(model)
    counts = []
    for timed in (1, 3):
        with ReadsByPlace() as reads:  # the loader's own reads (sampler, transforms) are not device reads
            rate = official_loops.mae_loop(model, tmp_path / "train", 32, 4, 0, Settings(), warmup=1, timed=timed)
        counts.append(sum(reads.where.values()))
        assert rate > 0
    assert not torch.equal(before, weights(model))
    assert counts[1] - counts[0] == 2  # its one loss.item() a step, none other


def test_uvit_loop_trains_on_cifar_pickles_with_its_python_ema(tmp_path):
    write_cifar100(tmp_path, n_train=16, n_test=4)
    loader = official_loops.uvit_loader(tmp_path, 4, 0)
    images, _ = next(iter(loader))
    assert images.min() >= -1.0 and images.max() <= 1.0 and images.min() < -0.5  # [-1, 1], the diffusion space
    torch.manual_seed(0)
    model = DiffusionModule(UViT(img_size=32, in_chans=3, patch_size=4, embed_dim=32, depth=2, num_heads=2, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}, num_classes=100), num_classes=100, class_conditional=True, num_sample_images=0)
    before = weights(model)
    rate = official_loops.uvit_loop(model, tmp_path, 4, 0, Settings(), warmup=1, timed=2)
    assert rate > 0 and not torch.equal(before, weights(model))


def test_the_python_ema_is_baofffs_update():
    torch.manual_seed(0)
    model, averaged = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    expected = [0.9 * a.detach().double() + 0.1 * p.detach().double()
                for a, p in zip(averaged.parameters(), model.parameters())]
    official_loops.ema_python_loop(averaged, model, 0.9)
    for got, want in zip(averaged.parameters(), expected):
        torch.testing.assert_close(got.detach().double(), want, rtol=0, atol=1e-7)


@pytest.mark.parametrize("peer", ["mae", "uvit"])
def test_the_breakdown_names_each_peer(peer):
    from benchmarks.fit_breakdown import PEERS
    from benchmarks.gpu_check import PEER

    assert peer in PEERS and peer in PEER.values()
