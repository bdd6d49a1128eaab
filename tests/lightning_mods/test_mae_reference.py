"""Our MAE is the decay paper's model (``unet_skips=True``) and He et al.'s (``unet_skips=False``,
alpha_min 1) parameter for parameter: same weights and masking noise give the same loss,
prediction, features and gradients as the independent references of ``tests/helpers/mae_references.py``
(timm ``Block``s and the published description), to float32 rounding. Plus MAE's
initialisation statistics and the ``int(L * (1 - ratio))`` visible count."""
from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.backbone.shortcut import ShortcutSchedule
from helpers.mae_references import AuthorsMAE, OfficialMAE, randomise_
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT

GEOMETRY = dict(img_size=16, in_chans=3, patch_size=4, embed_dim=32, num_heads=4, decoder_embed_dim=16,
                decoder_num_heads=2)

# ours -> the repositories' names (first matching rule)
RENAMES = [(r"^encoder\.norm\.", "norm."), (r"^encoder\.", ""), (r"^decoder\.cls_token$", "decoder_cls_token"),
           (r"^decoder\.mask_token$", "mask_token"), (r"^decoder\.embed\.", "decoder_embed."),
           (r"^decoder\.blocks\.", "decoder_blocks."), (r"^decoder\.norm\.", "decoder_norm."),
           (r"^decoder\.pred\.", "decoder_pred."), (r"^decoder\.fusions\.(\d+)\.fc1\.", r"skip.\1.fc.0."),
           (r"^decoder\.fusions\.(\d+)\.fc2\.", r"skip.\1.fc.2."),
           (r"^decoder\.fusions\.(\d+)\.mask_token$", r"skip.\1.mask_token")]


def reference_name(name: str) -> str:
    for pattern, repl in RENAMES:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    raise KeyError(name)


def assert_float32_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal to a few float32 roundings: the decayed sum is one fused ``add(f(x), x, alpha=a)``
    here and ``a * x + f(x)`` in the reference, which may round differently in the last bit;
    a gradient summed over every token and block (``cls_token``) gathers a few of those."""
    scale = want.detach().abs().max().clamp_min(1e-30)
    err = (got.detach() - want.detach()).abs().max()
    assert err <= 4e-6 * scale, f"{what}: max abs error {err:.3g} at scale {scale:.3g}"


def pair(kind: str, alpha_min: float, depth: int, decoder_depth: int, seed: int = 0):
    """A randomised reference and our model (default layout flags) holding the same weights."""
    ref_cls = AuthorsMAE if kind == "authors" else OfficialMAE
    dims = {k: v for k, v in GEOMETRY.items() if k not in ("img_size",)}
    ref = randomise_(ref_cls(img_size=16, depth=depth, decoder_depth=decoder_depth, min_decay=alpha_min, **dims), seed)
    ours = MaskedAutoencoderViT(**GEOMETRY, depth=depth, decoder_depth=decoder_depth, unet_skips=kind == "authors", shortcut=ShortcutSchedule("linear", alpha_min), norm_pix_loss=True, mask_ratio=0.75)
    ref_params = dict(ref.named_parameters())
    copied = set()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            theirs = ref_params[reference_name(name)]
            assert theirs.shape == p.shape, name
            if name == "encoder.pos_embed":  # fixed in both: ours must already be MAE's sin-cos
                torch.testing.assert_close(p, theirs, rtol=0, atol=1e-6)
            p.copy_(theirs)
            copied.add(reference_name(name))
    unused = {n for n in ref_params if re.match(r"skip\.(\d+)\.", n)
              and int(n.split(".")[1]) >= decoder_depth}  # the authors' fusions that never run
    fixed = {"decoder_pos_embed"}
    assert set(ref_params) - copied == unused | fixed
    torch.testing.assert_close(ours.decoder.pos_embed, ref.decoder_pos_embed, rtol=0, atol=1e-6)
    return ref, ours


CASES = [("authors", 0.6, 4, 2), ("authors", 1.0, 4, 3), ("authors", 0.6, 6, 2), ("authors", 1.0, 6, 2),
         ("official", 1.0, 3, 2), ("official", 0.6, 4, 2)]


@pytest.mark.parametrize("kind,alpha_min,depth,decoder_depth", CASES)
def test_loss_prediction_features_and_gradients_equal_the_reference(kind, alpha_min, depth, decoder_depth):
    ref, ours = pair(kind, alpha_min, depth, decoder_depth)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    loss, pred, mask = ours(images, generator=torch.Generator().manual_seed(5))
    noise = torch.rand(2, 16, generator=torch.Generator().manual_seed(5))  # the draw our masking makes
    ref_loss, ref_pred, ref_mask = ref(images, noise)
    torch.testing.assert_close(mask, ref_mask, rtol=0, atol=0)
    assert int(mask[0].sum()) == 12
    assert_float32_equal(pred, ref_pred, "prediction")
    assert_float32_equal(loss, ref_loss, "loss")
    assert_float32_equal(ours.forward_features(images), ref.features(images), "features")
    loss.backward()
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        if p.requires_grad:
            assert_float32_equal(p.grad, ref_params[reference_name(name)].grad, f"grad {name}")


def test_the_reference_tells_the_old_fusion_order_apart():
    """The check above can fail: swapping the fusion's input order ([stream, skip]) changes the
    prediction far beyond rounding."""
    ref, ours = pair("authors", 0.6, 4, 2)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    ref_pred = ref(images, torch.rand(2, 16, generator=torch.Generator().manual_seed(5)))[1]
    with torch.no_grad():  # fc1's columns rolled: what reading [stream, skip] with these weights does
        for fusion in ours.decoder.fusions:
            fusion.fc1.weight.copy_(torch.roll(fusion.fc1.weight, 16, dims=1))
    pred = ours(images, generator=torch.Generator().manual_seed(5))[1]
    assert (pred - ref_pred).abs().max() > 1e-3


# --- initialisation ------------------------------------------------------------------------------
INIT_DIMS = dict(img_size=16, in_chans=3, patch_size=4, embed_dim=128, depth=4, num_heads=4,
                 decoder_embed_dim=64, decoder_depth=3, decoder_num_heads=4)


def xavier_bound(fan_in: int, fan_out: int) -> float:
    return math.sqrt(6.0 / (fan_in + fan_out))


@pytest.mark.parametrize("unet_skips", [True, False])
def test_mae_initialisation_statistics(unet_skips):
    torch.manual_seed(0)
    # without skips at alpha_min 1: He et al.'s MAE
    standard = {} if unet_skips else {"shortcut": {"kind": "linear", "alpha_min": 1.0}}
    model = MaskedAutoencoderViT(**INIT_DIMS, unet_skips=unet_skips, **standard)
    zero_weights = set()
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            assert torch.all(m.bias == 0), name
            if torch.all(m.weight == 0):
                zero_weights.add(name)
                continue
            bound = xavier_bound(m.in_features, m.out_features)
            assert m.weight.abs().max() <= bound, name
            assert m.weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.12), name
        elif isinstance(m, nn.LayerNorm):
            assert m.eps == 1e-6, name
            assert torch.all(m.weight == 1) and torch.all(m.bias == 0), name
    if unet_skips:  # the authors zero every branch end, every fusion output and the prediction
        expected = {f"{part}.blocks.{i}.{layer}" for part, n in (("encoder", 4), ("decoder", 3)) for i in range(n)
                    for layer in ("attn.proj", "mlp.fc2")}
        expected |= {"decoder.fusions.0.fc2", "decoder.fusions.1.fc2", "decoder.pred"}
        assert zero_weights == expected
        assert isinstance(model.encoder.norm, nn.Identity)
    else:  # He et al. zero nothing and keep the final encoder norm
        assert zero_weights == set()
        assert isinstance(model.encoder.norm, nn.LayerNorm)
    # patch embedding: xavier on the flattened D x (C p p) view (fan_out = D, not D p p)
    w = model.encoder.patch_embed.proj.weight
    bound = xavier_bound(3 * 16, 128)
    assert w.abs().max() <= bound and w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)
    assert w.std().item() > 2 * xavier_bound(3 * 16, 128 * 16) / math.sqrt(3)  # not the conv's fans
    tokens = [model.encoder.cls_token] + [p for n, p in model.decoder.named_parameters()
                                          if n.endswith("token")]
    assert len(tokens) == (4 if unet_skips else 2)  # decoder cls + one mask token per fusion | mask token
    for t in tokens:
        assert t.std().item() == pytest.approx(0.02, rel=0.3)
    pos = model.encoder.pos_embed
    assert not pos.requires_grad and torch.all(pos[0, 0] == 0)


def test_explicit_flags_override_the_layout_defaults():
    model = MaskedAutoencoderViT(**INIT_DIMS, unet_skips=False, zero_init_branches=True, encoder_final_norm=False)
    assert torch.all(model.encoder.blocks[0].attn.proj.weight == 0) and torch.all(model.decoder.pred.weight == 0)
    assert isinstance(model.encoder.norm, nn.Identity)
    assert model.zero_init_branches is True and model.encoder_final_norm is False
    authors_unzeroed = MaskedAutoencoderViT(**INIT_DIMS, zero_init_branches=False)
    assert not torch.all(authors_unzeroed.decoder.fusions[0].fc2.weight == 0)


def test_decayed_classic_ablation_starts_its_branches_at_zero():
    """the decay paper, section 3.1: a decayed encoder needs the zero starts, with or without the skips."""
    model = MaskedAutoencoderViT(**INIT_DIMS, unet_skips=False, shortcut={"kind": "linear", "alpha_min": 0.6})
    assert model.zero_init_branches is True
    for i in range(4):
        assert torch.all(model.encoder.blocks[i].attn.proj.weight == 0)
        assert torch.all(model.encoder.blocks[i].mlp.fc2.weight == 0)
    assert isinstance(model.encoder.norm, nn.LayerNorm)  # still He et al.'s layout otherwise


def test_196_patches_at_mask_ratio_0_9_keep_19():
    model = MaskedAutoencoderViT(img_size=56, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=8, decoder_depth=1, decoder_num_heads=2, mask_ratio=0.9)
    loss, pred, mask = model(torch.randn(2, 1, 56, 56))
    assert pred.shape == (2, 196, 16)
    assert mask.sum(1).tolist() == [177.0, 177.0]  # int(196 * 0.1) = 19 visible, not round() = 20


def test_weight_decay_groups_follow_the_mae_repositories():
    """add_weight_decay of both repositories: no decay exactly for 1-D parameters (norms, biases);
    the cls and mask tokens (3-D) are decayed, the fixed position embeddings are not trained."""
    model = MaskedAutoencoder(MaskedAutoencoderViT(**INIT_DIMS))
    model.trainer = type("T", (), {"estimated_stepping_batches": 10, "datamodule": type("D", (), {"batch_size": 4})(),
                                   "world_size": 1, "num_nodes": 1, "num_devices": 1, "max_epochs": 10,
                                   "accumulate_grad_batches": 1})()
    decay, no_decay = set(), set()
    names = {id(p): n for n, p in model.named_parameters()}
    for group in model.configure_optimizers()["optimizer"].param_groups:
        (decay if group["weight_decay"] > 0 else no_decay).update(names[id(p)] for p in group["params"])
    expected_no_decay = {n for n, p in model.named_parameters() if p.requires_grad and p.ndim <= 1}
    assert no_decay == expected_no_decay
    assert {"network.encoder.cls_token", "network.decoder.cls_token", "network.decoder.fusions.0.mask_token"} <= decay
    assert "network.encoder.pos_embed" not in decay | no_decay
