"""Each named extension point: a subclass overriding it changes what it should
and nothing else. References are computed by hand in float64 numpy from what the base module
returns with the same weights and the same random draws."""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_mods.backbone import ResNet18Cifar, ShortcutSchedule
from lightning_mods.backbone.patches import patchify
from lightning_mods.classifier import ImageClassifier
from lightning_mods.diffusion import DiffusionModule
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from helpers.diffusion_modules import diffusion_module

MAE = dict(img_size=16, in_chans=1, patch_size=4, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16,
           decoder_depth=1, decoder_num_heads=2, norm_pix_loss=False, zero_init_branches=False)
DIFFUSION = dict(image_size=8, in_chans=1, patch_size=2, embed_dim=32, depth=2, num_heads=4, pixel_mean=[0.5],
                 pixel_std=[0.5], num_sampling_steps=4, zero_init_branches=False)


def twin(base_class, subclass, **kwargs):
    """``(base, subclass)`` instances with the same weights."""
    torch.manual_seed(0)
    build = partial(diffusion_module, base_class) if issubclass(base_class, DiffusionModule) else base_class
    base = build(**kwargs)
    other = (partial(diffusion_module, subclass) if build is not base_class else subclass)(**kwargs)
    other.load_state_dict(base.state_dict())
    return base.eval(), other.eval()


def images(n: int = 4, size: int = 16) -> torch.Tensor:
    return torch.rand(n, 1, size, size, generator=torch.Generator().manual_seed(1))


def masked_mean(per_patch: np.ndarray, mask: np.ndarray) -> float:
    return float((per_patch * mask).sum() / mask.sum())


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(7)


# --- MAE (the network's points; the recipe is given the network) ----------------------------------------------------------------------------------------
class DoubledTarget(MaskedAutoencoderViT):
    def reconstruction_target(self, images):
        return 2.0 * patchify(images, self.patch_size)


class L1Loss(MaskedAutoencoderViT):
    def reconstruction_loss(self, pred, target, mask):
        return ((pred - target).abs().mean(dim=-1) * mask).sum() / mask.sum()


class FirstHalfHidden(MaskedAutoencoderViT):
    def mask_patches(self, tokens, mask_ratio, generator=None):
        b, length, _ = tokens.shape
        hidden = length // 2
        ids_restore = torch.arange(length).roll(-hidden).expand(b, -1)  # [visible, hidden] -> patch order
        mask = torch.zeros(b, length)
        mask[:, :hidden] = 1
        return tokens[:, hidden:], mask, ids_restore


class ClsPooled(MaskedAutoencoderViT):
    def pool_features(self, tokens):
        return tokens[:, 0]


def test_mae_target_changes_the_loss_target_only():
    base, doubled = twin(MaskedAutoencoderViT, DoubledTarget, **MAE)
    x = images()
    loss_base, pred_base, mask_base = base(x, generator=generator())
    loss, pred, mask = doubled(x, generator=generator())
    assert torch.equal(pred, pred_base) and torch.equal(mask, mask_base)  # same prediction, same mask
    p, m = pred.detach().double().numpy(), mask.double().numpy()
    target = patchify(x, 4).double().numpy()
    assert loss.item() == pytest.approx(masked_mean(((p - 2 * target) ** 2).mean(-1), m), rel=1e-6)
    assert loss_base.item() == pytest.approx(masked_mean(((p - target) ** 2).mean(-1), m), rel=1e-6)


def test_mae_loss_changes_the_loss_only():
    base, l1 = twin(MaskedAutoencoderViT, L1Loss, **MAE)
    x = images()
    _, pred_base, mask_base = base(x, generator=generator())
    loss, pred, mask = l1(x, generator=generator())
    assert torch.equal(pred, pred_base) and torch.equal(mask, mask_base)
    p, m = pred.detach().double().numpy(), mask.double().numpy()
    assert loss.item() == pytest.approx(masked_mean(np.abs(p - patchify(x, 4).double().numpy()).mean(-1), m), rel=1e-6)


def test_mae_masking_decides_the_visible_patches_and_evaluation_is_unchanged():
    base, fixed = twin(MaskedAutoencoderViT, FirstHalfHidden, **MAE)
    x = images()
    _, pred, mask = fixed(x, mask_ratio=0.5)
    assert mask.tolist() == [[1.0] * 8 + [0.0] * 8] * 4
    # the encoder saw exactly the second half: its latent equals the encoder run on those tokens
    tokens = base._embed_patches(x)
    by_hand, _ = base._run_blocks(torch.cat([base._cls(4), tokens[:, 8:]], dim=1))
    latent, _, _, _ = fixed.encode_masked(x, 0.5)
    torch.testing.assert_close(latent, by_hand, rtol=0, atol=0)
    assert pred.shape == (4, 16, 16)
    torch.testing.assert_close(fixed.forward_features(x), base.forward_features(x), rtol=0, atol=0)


def test_mae_pooling_changes_the_features_only():
    base, cls = twin(MaskedAutoencoderViT, ClsPooled, **MAE)
    x = images()
    last, blocks = base.encode(x)
    torch.testing.assert_close(cls.forward_features(x), last[:, 0], rtol=0, atol=0)
    for mine, block in zip(cls.pooled_intermediates(x, intermediates_only=True), blocks):
        torch.testing.assert_close(mine, block[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(cls(x, generator=generator())[0], base(x, generator=generator())[0], rtol=0, atol=0)


# --- diffusion ----------------------------------------------------------------------------------
class TimeWeighted(DiffusionModule):
    def loss_weight(self, t):
        return 1.0 + t.float() / 1000.0


class NoNoise(DiffusionModule):
    def corrupt(self, x0, generator=None):
        t = torch.full((x0.shape[0],), 500, dtype=torch.long)
        return x0, t, torch.zeros_like(x0)


class AlwaysLabelled(DiffusionModule):
    def condition(self, labels, dropout, generator=None):
        return labels.long()


def test_diffusion_loss_weight_weights_each_sample_by_its_time():
    base, weighted = twin(DiffusionModule, TimeWeighted, **DIFFUSION)
    x0 = torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    x_t, t, noise = base.corrupt(x0, generator())
    with torch.no_grad():
        predicted = base(x_t, base.noise_process.network_time(t), None).double().numpy()
        per_sample = ((predicted - noise.double().numpy()) ** 2).reshape(6, -1).mean(1)
        expected = float((per_sample * (1.0 + t.double().numpy() / 1000.0)).mean())
        assert weighted.diffusion_loss(x0, None, generator()).item() == pytest.approx(expected, rel=1e-6)
        assert base.diffusion_loss(x0, None, generator()).item() == pytest.approx(float(per_sample.mean()), rel=1e-6)


def test_diffusion_corrupt_is_the_training_noise_process():
    base, clean = twin(DiffusionModule, NoNoise, **DIFFUSION)
    x0 = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        t = torch.full((3,), 500, dtype=torch.long)
        predicted = base(x0, base.noise_process.network_time(t), None).double()
        assert clean.diffusion_loss(x0, None).item() == pytest.approx(float((predicted ** 2).mean()), rel=1e-6)


def test_diffusion_condition_decides_the_network_input():
    kwargs = {**DIFFUSION, "num_classes": 3, "class_conditional": True, "label_dropout": 1.0}
    base, labelled = twin(DiffusionModule, AlwaysLabelled, **kwargs)
    labels = torch.tensor([0, 1, 2, 1])
    assert base.condition(labels, 1.0).tolist() == [base.network.null_class] * 4  # every label dropped
    assert labelled.condition(labels, 1.0).tolist() == [0, 1, 2, 1]
    # the training step hands the network what condition() gives
    seen = []
    for module in (base, labelled):
        module.network.register_forward_hook(lambda _m, args, _out: seen.append(args[2].tolist()))
        module.log = lambda *a, **k: None
        module.training_step((torch.rand(4, 1, 8, 8), labels), 0)
    assert seen == [[base.network.null_class] * 4, [0, 1, 2, 1]]


# --- classifier ---------------------------------------------------------------------------------
class SquaredErrorLoss(ImageClassifier):
    def training_loss(self, logits, labels):
        return F.mse_loss(logits.softmax(-1), F.one_hot(labels, logits.shape[-1]).float())


class HalvedHead(ImageClassifier):
    def forward_head(self, feature_map):
        return 0.5 * self.network.forward_head(feature_map)


def classifier_twin(subclass):
    torch.manual_seed(0)
    base = ImageClassifier(ResNet18Cifar(shortcut=ShortcutSchedule("linear", 0.6)), num_classes=5, in_chans=1).eval()
    other = subclass(ResNet18Cifar(shortcut=ShortcutSchedule("linear", 0.6)), num_classes=5, in_chans=1).eval()
    other.load_state_dict(base.state_dict())
    return base, other


def test_classifier_training_loss_is_what_the_step_minimises():
    base, squared = classifier_twin(SquaredErrorLoss)
    x, labels = images(4, 16), torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        probs = base(x).double().softmax(-1).numpy()
        expected = float(((probs - np.eye(5)[labels.numpy()]) ** 2).mean())
        assert squared.training_loss(squared(x), labels).item() == pytest.approx(expected, rel=1e-6)
        torch.testing.assert_close(squared(x), base(x), rtol=0, atol=0)  # the network is the same


def test_classifier_head_changes_the_logits_only():
    base, halved = classifier_twin(HalvedHead)
    x = images(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(halved(x), 0.5 * base.network(x), rtol=0, atol=0)
        torch.testing.assert_close(halved.forward_features(x), base.forward_features(x), rtol=0, atol=0)
