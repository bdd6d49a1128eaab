"""``shortcutlab predict`` writes embeddings, logits and labels for every family.

The written file is checked against an independent forward pass: a fresh module built from
the checkpoint's own state_dict, run on the datamodule's held-out images outside Lightning.
"""
from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from commands import lightning_cli as cli
from callbacks.reporting.prediction_writer import PredictionWriter, concatenate_predictions, merge_in_dataset_order
from datamodules.digits import Digits
from lightning_mods.diffusion import DiffusionModule
from lightning_mods.linear_probe import LinearProbe
from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.backbone.resnet import ResNet18Cifar
from lightning_mods.backbone.shortcut import ShortcutSchedule
from helpers.composed_configs import command_args
from test_cli import DIGITS, TINY_MAE, run_fit
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.backbone.uvit import UViT

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.enable_progress_bar=false"]


def held_out_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """Every held-out image and label of the 16x16 digits, in order, outside Lightning."""
    dm = Digits(batch_size=32, image_size=16)
    dm.setup("predict")
    images, labels = zip(*(dm.predict_dataset[i] for i in range(len(dm.predict_dataset))))
    return torch.stack(images), torch.as_tensor(labels)


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


def test_mae_predict_writes_the_checkpoint_encoders_embeddings(tmp_path):
    ckpt = run_fit(tmp_path / "fit")
    out = cli.main(["predict", *TINY_MAE, *DIGITS, f"--ckpt_path={ckpt}", *QUIET,
                    f"--trainer.default_root_dir={tmp_path / 'predict'}"])
    (path,) = sorted((tmp_path / "predict").rglob("predictions.pt"))
    predictions = torch.load(path, weights_only=True)
    assert set(predictions) == {"embeddings", "labels", "indices"}

    images, labels = held_out_digits()
    reference = MaskedAutoencoder(MaskedAutoencoderViT(img_size=16, in_chans=1, patch_size=8, embed_dim=32, depth=4, num_heads=2, decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2))
    reference.load_state_dict(checkpoint_weights(ckpt))
    with torch.no_grad():
        expected = reference.eval().forward_features(images)
    assert torch.equal(predictions["labels"], labels)
    assert torch.equal(predictions["indices"], torch.arange(len(labels)))
    torch.testing.assert_close(predictions["embeddings"], expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(expected, MaskedAutoencoder(MaskedAutoencoderViT(img_size=16, in_chans=1, patch_size=8, embed_dim=32, depth=4, num_heads=2, decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2)).eval().forward_features(images), atol=1e-3)
    assert [cb.written for cb in out.trainer.callbacks if isinstance(cb, PredictionWriter)] == [path]


def test_classifier_predict_writes_embeddings_and_logits(tmp_path):
    common = [*command_args("digits_resnet18_quick"), *QUIET,
              "--trainer.callbacks=[]"]
    cli.main(["fit", *common, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
              "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path / 'fit'}"])
    (ckpt,) = sorted((tmp_path / "fit").rglob("*.ckpt"))
    cli.main(["predict", *common, f"--ckpt_path={ckpt}", f"--trainer.default_root_dir={tmp_path / 'predict'}"])
    (path,) = sorted((tmp_path / "predict").rglob("predictions.pt"))
    predictions = torch.load(path, weights_only=True)
    assert set(predictions) == {"embeddings", "logits", "labels", "indices"}

    images, labels = held_out_digits()
    hparams = torch.load(ckpt, map_location="cpu", weights_only=True)["hyper_parameters"]
    backbone = ResNet18Cifar(num_blocks=8, channels=[16, 32, 64, 128], num_classes=10, in_chans=1,
                             shortcut=ShortcutSchedule(kind="linear", alpha_min=0.6), act_layer="relu",
                             norm_layer="batchnorm2d")
    backbone.load_state_dict({k.removeprefix("network."): v for k, v in checkpoint_weights(ckpt).items()})
    backbone.eval()
    with torch.no_grad():
        features = backbone.forward_features(images)
        pooled = features.mean(dim=(2, 3))
        logits = backbone(images)
    assert hparams["num_classes"] == 10
    assert torch.equal(predictions["labels"], labels)
    torch.testing.assert_close(predictions["embeddings"], pooled, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(predictions["logits"], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(predictions["logits"], pooled @ backbone.fc.weight.T + backbone.fc.bias,
                               rtol=1e-5, atol=1e-5)


def test_diffusion_and_probe_predict_steps_write_their_features(tmp_path):
    images = torch.randn(6, 1, 8, 8)
    labels = torch.arange(6) % 3
    loader = DataLoader(TensorDataset(images, labels), batch_size=4)
    diffusion = DiffusionModule(UViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=3, num_heads=2, zero_init_branches=True, shortcut={"kind": "linear", "alpha_min": 0.7}), num_classes=3)
    probe = LinearProbe(MaskedAutoencoder(MaskedAutoencoderViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=8, decoder_depth=1, decoder_num_heads=2)),
                        num_classes=3)
    for name, module in (("diffusion", diffusion), ("probe", probe)):
        path = tmp_path / f"{name}.pt"
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[PredictionWriter(str(path))], default_root_dir=tmp_path)
        trainer.predict(module, loader, return_predictions=False)
        written = torch.load(path, weights_only=True)
        module.eval()
        with torch.no_grad():
            features = module.backbone.forward_features(images) if name == "probe" else module.forward_features(images)
        torch.testing.assert_close(written["embeddings"][:4], features[:4], rtol=1e-5, atol=1e-6)
        assert torch.equal(written["labels"], labels) and torch.equal(written["indices"], torch.arange(6))
        if name == "probe":
            torch.testing.assert_close(written["logits"], probe.head(features), rtol=1e-5, atol=1e-6)


def test_ranks_merge_in_dataset_order_without_the_padding_repeats():
    n, world = 7, 3  # DistributedSampler pads 7 samples to 9 by repeating two
    values = torch.arange(n, dtype=torch.float32)[:, None] * torch.tensor([[1.0, -1.0]])
    parts = []
    for rank in range(world):
        order = list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=3))
        batches = [order[i:i + 2] for i in range(0, len(order), 2)]
        parts.append(concatenate_predictions([{"embeddings": values[b], "labels": torch.tensor(b)} for b in batches],
                                             batches))
    assert sum(len(p["indices"]) for p in parts) == 9
    merged = merge_in_dataset_order(parts)
    assert torch.equal(merged["indices"], torch.arange(n))
    assert torch.equal(merged["labels"], torch.arange(n))
    assert torch.equal(merged["embeddings"], values)
