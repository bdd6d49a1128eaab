"""ImageClassifier (the decay paper, appendix B.2): stock-timm equality, features, head/stem adaptation, recipe."""
from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mods.classifier import ImageClassifier
from lightning_mods.backbone.residual import timm_state_dict
from lightning_mods.backbone.resnet import ResNet18Cifar, ResNet50, ResNet50d
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.vit import DecayedVisionTransformer
from helpers.reference_stems import reference_cifar_stem

NONE = ShortcutSchedule("none")


def randomise_batchnorm_(model: nn.Module) -> None:
    """Non-trivial BN statistics and affine weights (zero-init would hide the branches)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.rand(m.num_features, generator=gen) - 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)


def without_prefix(state: dict, prefix: str = "network.") -> dict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


CASES = {
    # ours (built with timm defaults, then adapted to num_classes/in_chans), stock timm with the target args
    "resnet18_cifar": (lambda: ResNet18Cifar(shortcut=NONE),
                       lambda nc, ic: reference_cifar_stem(ResNet(BasicBlock, (2, 2, 2, 2), num_classes=nc, in_chans=ic), ic)),
    "resnet50": (lambda: ResNet50(shortcut=NONE),
                 lambda nc, ic: ResNet(Bottleneck, (3, 4, 6, 3), num_classes=nc, in_chans=ic)),
    "resnet50d": (lambda: ResNet50d(shortcut=NONE),
                  lambda nc, ic: ResNet(Bottleneck, (3, 4, 6, 3), num_classes=nc, in_chans=ic, stem_width=32,
                                        stem_type="deep", avg_down=True)),
}


@pytest.mark.parametrize("name,in_chans", [("resnet18_cifar", 3), ("resnet18_cifar", 1), ("resnet50", 3),
                                           ("resnet50d", 1)])
def test_kind_none_logits_equal_stock_timm(name, in_chans):
    build, stock = CASES[name]
    torch.manual_seed(0)
    model = ImageClassifier(build(), num_classes=7, in_chans=in_chans)
    randomise_batchnorm_(model)
    ref = stock(7, in_chans)
    ref.load_state_dict(without_prefix(timm_state_dict(model)))  # strict: same keys and shapes
    images = torch.randn(2, in_chans, 32, 32)
    model.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(model(images), ref(images))
    model.train(), ref.train()
    with torch.no_grad():
        assert torch.equal(model(images), ref(images))


def test_backbone_already_matching_is_used_as_is():
    backbone = ResNet18Cifar(num_classes=10, in_chans=1, channels=(8, 8, 8, 8))
    head, stem = backbone.fc, backbone.conv1
    model = ImageClassifier(backbone, num_classes=10, in_chans=1)
    assert model.network.fc is head and model.network.conv1 is stem


def test_head_and_stem_are_adapted():
    model = ImageClassifier(ResNet50d(), num_classes=3, in_chans=1)
    assert model.network.fc.out_features == 3
    assert model.network.conv1[0].in_channels == 1
    assert model.network.conv1[0].out_channels == 32 and model.network.conv1[0].stride == (2, 2)
    plain = ImageClassifier(ResNet50(), num_classes=3, in_chans=1).network.conv1
    assert plain.weight.shape == (64, 1, 7, 7) and plain.stride == (2, 2) and plain.padding == (3, 3)
    # Kaiming normal, fan-out, ReLU gain (timm's ResNet init): std sqrt(2 / (64 * 7 * 7))
    assert plain.weight.std().item() == pytest.approx(math.sqrt(2 / (64 * 49)), rel=0.1)


def small_classifier(**kwargs) -> ImageClassifier:
    torch.manual_seed(0)
    backbone = ResNet18Cifar(shortcut=ShortcutSchedule("linear", 0.6), channels=(8, 16, 16, 32))
    return ImageClassifier(backbone, num_classes=10, in_chans=3, **kwargs)


def test_features_are_the_pooled_input_of_the_head_and_blocks_are_pooled_per_block():
    model = small_classifier().eval()
    randomise_batchnorm_(model)
    images = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        feats = model.forward_features(images)
        assert feats.shape == (3, 32)
        torch.testing.assert_close(model.network.fc(feats), model(images))
        blocks = model.forward_intermediates(images, intermediates_only=True)
        assert [b.shape for b in blocks] == [(3, c) for c in (8, 8, 16, 16, 16, 16, 32, 32)]
        # the last block's output is the backbone's last feature map
        torch.testing.assert_close(blocks[-1], model.network.forward_features(images).mean(dim=(2, 3)))
        # an earlier block by hand: stem, then layer1 block 0
        stem = model.network.maxpool(model.network.act1(model.network.bn1(model.network.conv1(images))))
        torch.testing.assert_close(blocks[0], model.network.layer1[0](stem).mean(dim=(2, 3)))
    assert all(not blk._forward_hooks for blk in model.network.modules())


def test_label_smoothed_training_loss_matches_the_formula():
    model = small_classifier(label_smoothing=0.2)
    images, labels = torch.randn(4, 3, 16, 16), torch.tensor([0, 3, 9, 3])
    with pytest.warns(UserWarning, match="self.log"):
        loss = model.training_step((images, labels), 0)
    log_p = torch.log_softmax(model(images).double(), dim=1)
    expected = -(0.8 * log_p.gather(1, labels[:, None]).squeeze(1) + 0.2 * log_p.mean(dim=1)).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def fit_a_few_steps(tmp_path, model, batch_size=8, epochs=2, n=32):
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 3, 16, 16, generator=gen), torch.randint(0, 10, (n,), generator=gen))
    lrs = []

    class LrLog(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[LrLog()],
                        default_root_dir=str(tmp_path))
    trainer.fit(model, DataLoader(data, batch_size=batch_size, shuffle=True),
                DataLoader(data, batch_size=batch_size))
    return trainer, lrs


def test_sgd_recipe_scales_lr_warms_up_and_skips_decay_on_norms_and_biases(tmp_path):
    model = small_classifier(base_lr=0.1, warmup_epochs=1, weight_decay=1e-4)
    trainer, lrs = fit_a_few_steps(tmp_path, model)  # 4 batches of 8 per epoch, 2 epochs
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.defaults["nesterov"] and optimizer.defaults["momentum"] == 0.9
    peak = 0.1 * 8 / 256
    total, warmup = 8, 4
    expected = [peak * s / warmup for s in range(warmup)]  # from 0 (lightning_mods/recipe/optim.py)
    expected += [peak * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))) for s in range(warmup, total)]
    assert lrs == pytest.approx(expected, rel=1e-9)
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] == 1e-4 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.ndim > 1), name  # conv/linear weights only
    assert "val/top1" in trainer.callback_metrics and "val/top5" in trainer.callback_metrics


def test_adamw_recipe(tmp_path):
    model = small_classifier(optimizer="adamw", base_lr=1e-3, betas=(0.8, 0.9), warmup_epochs=0)
    trainer, lrs = fit_a_few_steps(tmp_path, model, epochs=1)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.8, 0.9)
    assert lrs[0] == pytest.approx(1e-3 * 8 / 256)


def test_top5_counts_a_label_in_the_five_best_logits():
    model = small_classifier()
    logits = torch.tensor([[9.0, 8, 7, 6, 5, 4, 3, 2, 1, 0]] * 2)
    model.val_top5(logits, torch.tensor([4, 5]))
    model.val_top1(logits, torch.tensor([0, 5]))
    assert model.val_top5.compute().item() == pytest.approx(0.5)
    assert model.val_top1.compute().item() == pytest.approx(0.5)


def test_top1_is_the_fraction_of_samples_right_not_the_mean_of_class_recalls():
    """Class sizes 4 / 1 / 1, five of six right: top-1 is 5/6. The mean of the per-class
    recalls (torchmetrics' default average) would be (1 + 1 + 0) / 3 = 2/3."""
    model = small_classifier()
    logits = nn.functional.one_hot(torch.tensor([0, 0, 0, 0, 1, 0]), 10).float()
    labels = torch.tensor([0, 0, 0, 0, 1, 2])
    for metric in (model.train_top1, model.val_top1, model.test_top1):
        metric(logits, labels)
        assert metric.compute().item() == pytest.approx(5 / 6)


def test_hparams_hold_no_module_and_checkpoints_load_weights_only(tmp_path):
    model = small_classifier()
    assert model.hparams["network"] == "lightning_mods.backbone.resnet.ResNet18Cifar"
    assert model.hparams_initial["network"] == "lightning_mods.backbone.resnet.ResNet18Cifar"
    trainer, _ = fit_a_few_steps(tmp_path, model, epochs=1)
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["hyper_parameters"]["network"] == "lightning_mods.backbone.resnet.ResNet18Cifar"


def test_droppath_baseline_is_the_backbones_stochastic_depth():
    model = ImageClassifier(ResNet18Cifar(drop_path_rate=0.1, channels=(8, 8, 8, 8)), num_classes=10, in_chans=3)
    rates = [blk.drop_path.drop_prob for blk in model.network.modules() if getattr(blk, "drop_path", None)]
    assert rates == pytest.approx([0.1 * i / 7 for i in range(1, 8)])  # timm: linear over the 8 blocks


@pytest.mark.parametrize("kwargs,field", [
    (dict(optimizer="adam"), "optimizer"),
    (dict(label_smoothing=1.0), "label_smoothing"),
    (dict(num_classes=0), "num_classes"),
    (dict(base_lr=0.0), "base_lr"),
    (dict(momentum=0.0), "nesterov"),
])
def test_bad_arguments_raise(kwargs, field):
    args = dict(num_classes=10, in_chans=3, **kwargs) if "num_classes" not in kwargs else dict(in_chans=3, **kwargs)
    with pytest.raises(ValueError, match=field):
        ImageClassifier(ResNet18Cifar(channels=(8, 8, 8, 8)), **args)


def test_a_backbone_without_the_timm_api_is_refused():
    with pytest.raises(ValueError, match="timm's classifier API"):
        ImageClassifier(nn.Linear(3, 3), num_classes=3)



def test_a_vit_backbone_works_too():
    torch.manual_seed(0)
    vit = DecayedVisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=2, num_heads=2)
    model = ImageClassifier(vit, num_classes=4, in_chans=1).eval()
    assert model.network.patch_embed.proj.in_channels == 1 and model.network.head.out_features == 4
    images = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        assert model(images).shape == (2, 4)
        assert model.forward_features(images).shape == (2, 16)
        tokens = model.network.forward_features(images)
        blocks = model.forward_intermediates(images, intermediates_only=True)
    assert len(blocks) == 2 and blocks[-1].shape == (2, 16)
    torch.testing.assert_close(blocks[-1], model.network.blocks[-1](model.network.blocks[0](
        model.network.norm_pre(model.network._pos_embed(model.network.patch_embed(images))))).mean(dim=1))
    assert tokens.shape[1] == 5  # cls + 4 patches
