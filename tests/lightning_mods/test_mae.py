"""MAE with U-Net skips (the decay paper, section 4): masking, loss, patches, decoder wiring, zero init."""
import numpy as np
import pytest
import torch
from torch import nn

from lightning_mods.backbone.masked_autoencoder import masked_patch_loss, normalise_patches
from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.backbone.mae_decoder import ClassicDecoder, SkipFusion, UNetSkipDecoder
from lightning_mods.backbone.patches import patchify, random_masking, sincos_pos_embed_2d, unpatchify
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT

TINY = dict(img_size=16, in_chans=2, patch_size=4, embed_dim=32, depth=6, num_heads=4,
            decoder_embed_dim=16, decoder_depth=2, decoder_num_heads=2)


@pytest.mark.parametrize("L,ratio,keep", [(16, 0.75, 4), (49, 0.75, 12), (64, 0.6, 25), (10, 0.33, 6),
                                          (196, 0.75, 49), (196, 0.9, 19)])
def test_masking_keeps_int_of_visible_fraction(L, ratio, keep):
    """Both MAE codes keep ``int(L * (1 - ratio))`` patches (rounding would keep 26, 7 and 20)."""
    torch.manual_seed(0)
    tokens = torch.randn(5, L, 3)
    visible, mask, ids_restore, ids_keep = random_masking(tokens, ratio)
    assert visible.shape == (5, keep, 3)
    assert torch.all(mask.sum(dim=1) == L - keep)
    for b in range(5):
        kept = set(np.flatnonzero(mask[b].numpy() == 0).tolist())
        assert kept == set(ids_keep[b].tolist())
        # the visible tokens are exactly the original tokens at those positions
        torch.testing.assert_close(visible[b], tokens[b, ids_keep[b]], rtol=0, atol=0)
        # ids_restore inverts the shuffle: position ids_restore[i] of the shuffled list is token i
        assert sorted(ids_restore[b].tolist()) == list(range(L))


def test_masks_differ_between_samples():
    torch.manual_seed(0)
    _, mask, _, _ = random_masking(torch.zeros(8, 64, 1), 0.75)
    assert len({tuple(m.tolist()) for m in mask}) == 8


def test_patchify_matches_a_hand_loop_and_round_trips():
    torch.manual_seed(0)
    images = torch.randn(2, 3, 8, 12)[:, :, :, :8]  # 8x8, non-contiguous on purpose
    p = 4
    patches = patchify(images, p)
    ref = np.zeros((2, 4, p * p * 3), dtype=np.float32)
    imgs = images.numpy()
    for b in range(2):
        for gi in range(2):
            for gj in range(2):
                block = imgs[b, :, gi * p:(gi + 1) * p, gj * p:(gj + 1) * p]  # C x p x p
                ref[b, gi * 2 + gj] = block.transpose(1, 2, 0).reshape(-1)
    np.testing.assert_array_equal(patches.numpy(), ref)
    torch.testing.assert_close(unpatchify(patches, p, 3), images, rtol=0, atol=0)
    with pytest.raises(ValueError, match="patch_size"):
        patchify(torch.zeros(1, 1, 10, 10), 4)


def test_loss_counts_masked_patches_only_float64_reference():
    torch.manual_seed(0)
    pred, target = torch.randn(3, 8, 5), torch.randn(3, 8, 5)
    mask = (torch.rand(3, 8) > 0.5).float()
    mask[:, 0] = 1.0
    p, t, m = pred.double().numpy(), target.double().numpy(), mask.double().numpy()
    expected = (((p - t) ** 2).mean(-1) * m).sum() / m.sum()
    assert masked_patch_loss(pred, target, mask).item() == pytest.approx(expected, rel=1e-6)
    # changing predictions on visible patches does not change the loss
    pred2 = pred.clone()
    pred2[mask == 0] += 100.0
    assert masked_patch_loss(pred2, target, mask).item() == pytest.approx(expected, rel=1e-6)


def test_model_loss_is_masked_only_mse_of_its_prediction():
    torch.manual_seed(0)
    model = MaskedAutoencoder(MaskedAutoencoderViT(**TINY, norm_pix_loss=False))
    images = torch.randn(2, 2, 16, 16)
    loss, pred, mask = model(images, generator=torch.Generator().manual_seed(7))
    target = patchify(images, 4).double().numpy()
    m = mask.double().numpy()
    expected = (((pred.detach().double().numpy() - target) ** 2).mean(-1) * m).sum() / m.sum()
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert torch.all(mask.sum(1) == 12)  # 16 patches, 4 kept


def test_norm_pix_target_float64_reference():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 12)
    xd = x.double().numpy()
    ref = (xd - xd.mean(-1, keepdims=True)) / np.sqrt(xd.var(-1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(normalise_patches(x).numpy(), ref, rtol=1e-5, atol=1e-5)


def test_sincos_embedding_hand_computed_entries():
    D, g = 16, 4
    emb = sincos_pos_embed_2d(D, g, cls_token=True).double().numpy()
    assert emb.shape == (1 + g * g, D)
    assert np.all(emb[0] == 0)
    row, col = 1, 2
    e = emb[1 + row * g + col]
    # omega_0 = 1: first quarter sin(col), second cos(col), third sin(row), fourth cos(row)
    assert e[0] == pytest.approx(np.sin(2.0)) and e[D // 4] == pytest.approx(np.cos(2.0))
    assert e[D // 2] == pytest.approx(np.sin(1.0)) and e[3 * D // 4] == pytest.approx(np.cos(1.0))
    omega_1 = 1.0 / 10000 ** (1 / (D / 4))
    assert e[1] == pytest.approx(np.sin(2.0 * omega_1))



def test_sincos_embedding_is_timms_table_permuted_up_to_float32_rounding():
    """Why patches.py keeps its own table: timm's is a channel permutation of it, computed in float32."""
    from timm.layers.pos_embed_sincos import build_sincos2d_pos_embed

    D, g = 64, 8
    q = D // 4
    timm_table = build_sincos2d_pos_embed([g, g], D)  # [sin(row), sin(col), cos(row), cos(col)]
    quarter = [torch.arange(i * q, (i + 1) * q) for i in range(4)]
    as_mae = timm_table[:, torch.cat([quarter[1], quarter[3], quarter[0], quarter[2]])]
    ours = sincos_pos_embed_2d(D, g)
    torch.testing.assert_close(as_mae, ours, rtol=0, atol=1e-6)
    assert not torch.equal(as_mae, ours)  # float32 angles: not the MAE table bit for bit

def test_skip_sources_deepest_first_and_fusion_shapes():
    dec = UNetSkipDecoder(num_patches=16, enc_dim=32, enc_depth=12, dec_dim=16, depth=8, num_heads=2, patch_dim=10)
    assert dec.skip_sources == [11, 9, 7, 5, 3, 1]
    assert len(dec.fusions) == 6
    short = UNetSkipDecoder(num_patches=16, enc_dim=32, enc_depth=12, dec_dim=16, depth=4, num_heads=2, patch_dim=10)
    assert short.skip_sources == [11, 9, 7, 5]
    fusion = SkipFusion(16, 32)
    assert fusion.fc1.in_features == 48 and fusion.fc2.out_features == 16 and fusion.mask_token.shape == (1, 1, 32)
    ids_restore = torch.argsort(torch.rand(3, 16), dim=1)
    out = fusion(torch.randn(3, 17, 16), torch.randn(3, 5, 32), ids_restore)  # cls + 4 visible of 16
    assert out.shape == (3, 17, 16)


def test_skips_carry_masked_positions_as_their_fusions_mask_token():
    """Each fusion reads ``[skip, stream]``: the skip (encoder width) comes first, with that
    fusion's own mask token at masked positions."""
    torch.manual_seed(0)
    dec = UNetSkipDecoder(num_patches=4, enc_dim=8, enc_depth=4, dec_dim=4, depth=2, num_heads=2, patch_dim=3)
    seen = []
    for fusion in dec.fusions:
        fusion.fc1.register_forward_hook(lambda m, inp, out: seen.append(inp[0][0, :, :8]))
    assert not torch.equal(dec.fusions[0].mask_token, dec.fusions[1].mask_token)
    deep, shallow = torch.randn(1, 1 + 2, 8), torch.randn(1, 1 + 2, 8)  # cls + 2 visible
    ids_restore = torch.tensor([[2, 0, 3, 1]])  # patch 0 -> shuffled slot 2 (masked), patch 1 -> slot 0 ...
    dec([torch.zeros(1, 3, 8), shallow, torch.zeros(1, 3, 8), deep], ids_restore)
    for skip, tokens, fusion in zip(seen, (deep, shallow), dec.fusions):
        torch.testing.assert_close(skip[0], tokens[0, 0])             # cls
        torch.testing.assert_close(skip[2], tokens[0, 1])             # patch 1 was visible slot 0
        torch.testing.assert_close(skip[4], tokens[0, 2])             # patch 3 was visible slot 1
        torch.testing.assert_close(skip[1], fusion.mask_token[0, 0])  # patch 0 masked
        torch.testing.assert_close(skip[3], fusion.mask_token[0, 0])  # patch 2 masked


@pytest.mark.parametrize("unet_skips", [True, False])
def test_zero_init_prediction_depends_only_on_biases(unet_skips):
    torch.manual_seed(0)
    model = MaskedAutoencoder(MaskedAutoencoderViT(**TINY, unet_skips=unet_skips, zero_init_branches=True))
    with torch.no_grad():
        model.network.decoder.pred.bias.normal_()
    _, pred_a, _ = model(torch.randn(2, 2, 16, 16))
    _, pred_b, _ = model(torch.randn(2, 2, 16, 16) * 5)
    bias = model.network.decoder.pred.bias.detach()
    torch.testing.assert_close(pred_a, bias.expand_as(pred_a), rtol=0, atol=0)
    torch.testing.assert_close(pred_b, bias.expand_as(pred_b), rtol=0, atol=0)


class ZeroOut(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


@pytest.mark.parametrize("unet_skips", [True, False])
def test_classic_decoder_reads_the_encoder_output_and_the_unet_decoder_does_not(unet_skips):
    """Zeroing the encoder's output (its final-norm slot) wipes the input out of the classic
    decoder's prediction and leaves the U-Net decoder's, which reads the blocks, unchanged."""
    torch.manual_seed(0)
    model = MaskedAutoencoder(MaskedAutoencoderViT(**TINY, unet_skips=unet_skips, zero_init_branches=False))
    assert isinstance(model.network.decoder, ClassicDecoder) != unet_skips
    with torch.no_grad():
        model.network.decoder.pred.weight.normal_()
        for fusion in getattr(model.network.decoder, "fusions", []):
            for p in fusion.parameters():
                p.normal_(std=0.2)
    a, b = torch.randn(2, 2, 16, 16), torch.randn(2, 2, 16, 16)
    with torch.no_grad():
        torch.manual_seed(1)
        pred_a = model(a)[1]
        model.network.encoder.norm = ZeroOut()
        torch.manual_seed(1)
        zeroed_a = model(a)[1]
        torch.manual_seed(1)
        zeroed_b = model(b)[1]  # same mask (same seed), other images
    if unet_skips:
        torch.testing.assert_close(zeroed_a, pred_a, rtol=0, atol=0)
    else:
        assert not torch.allclose(zeroed_a, pred_a)
        torch.testing.assert_close(zeroed_a, zeroed_b, rtol=0, atol=0)


def test_forward_features_is_mean_of_last_block_tokens():
    torch.manual_seed(0)
    model = MaskedAutoencoder(MaskedAutoencoderViT(**TINY, zero_init_branches=False, shortcut=ShortcutSchedule("linear", 0.5))).eval()
    images = torch.randn(3, 2, 16, 16)
    enc = model.network.encoder
    with torch.no_grad():
        x = enc.patch_embed(images) + enc.pos_embed[:, 1:]
        x = torch.cat([(enc.cls_token + enc.pos_embed[:, :1]).expand(3, -1, -1), x], 1)
        alphas = 1.0 - np.arange(12) / 11 * 0.5
        outs = []
        for i, blk in enumerate(enc.blocks):
            x = alphas[2 * i] * x + blk.attn(blk.norm1(x))
            x = alphas[2 * i + 1] * x + blk.mlp(blk.norm2(x))
            outs.append(x.mean(1))
        torch.testing.assert_close(model.forward_features(images), outs[-1], rtol=0, atol=1e-5)
        for got, want in zip(model.forward_intermediates(images, intermediates_only=True), outs):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert model.forward_features(images).shape == (3, 32)


def test_pos_embed_is_fixed_and_other_parameters_learn():
    torch.manual_seed(0)
    model = MaskedAutoencoder(MaskedAutoencoderViT(**TINY))
    assert not model.network.encoder.pos_embed.requires_grad
    loss, _, _ = model(torch.randn(2, 2, 16, 16))
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []


def test_without_skips_an_odd_depth_and_a_final_norm_all_learn():
    torch.manual_seed(0)
    model = MaskedAutoencoder(MaskedAutoencoderViT(**{**TINY, "depth": 3}, unet_skips=False, encoder_final_norm=True))
    model(torch.randn(2, 2, 16, 16))[0].backward()
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []


@pytest.mark.parametrize("kwargs,field", [({"mask_ratio": 1.0}, "mask_ratio"), ({"img_size": 18}, "img_size"),
                                          ({"feature_pool": "max"}, "feature_pool"), ({"depth": 0}, "depth"),
                                          ({"depth": -2}, "depth"), ({"depth": 5}, "depth must be even"),
                                          ({"encoder_final_norm": True}, "encoder_final_norm"),
                                          ({"mask_ratio": 0.95}, "leaves no visible patch")])
def test_bad_settings(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        MaskedAutoencoder(MaskedAutoencoderViT(**{**TINY, **kwargs}))
    assert "\n" not in str(err.value)


def test_reconstruction_picture_labels_its_rows_and_columns(monkeypatch):
    from types import SimpleNamespace

    import lightning_mods.mae as mae

    model = MaskedAutoencoder(MaskedAutoencoderViT(img_size=16, in_chans=1, patch_size=4, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2), num_reconstructions=2)
    model.trainer = SimpleNamespace(sanity_checking=False, current_epoch=1, global_step=7,
                                    datamodule=SimpleNamespace(mean=(0.5,), std=(0.25,)))
    logged = {}
    monkeypatch.setattr(mae, "log_picture", lambda trainer, tag, picture: logged.update({tag: picture}))
    images = torch.randn(3, 1, 16, 16)
    model._val_images = images[:2]
    model.on_validation_epoch_end()
    ax = logged["mae/reconstructions"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["original", "masked input", "reconstruction"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["val 0", "val 1"]
    assert "epoch 1, step 7" in ax.get_title() and "75% of the patches masked" in ax.get_title()
    # the first tile is the original image, un-normalised (x * std + mean) and clipped to [0, 1]
    grid = np.asarray(ax.images[0].get_array())
    original = (images[0, 0] * 0.25 + 0.5).clamp(0, 1).numpy()
    np.testing.assert_allclose(grid[2:2 + 96:6, 2:2 + 96:6], original, atol=1e-6)  # 16 px tiles enlarged 6x


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.0])
def test_a_mask_ratio_outside_0_1_is_refused_in_one_line(ratio):
    with pytest.raises(ValueError) as err:
        MaskedAutoencoder(MaskedAutoencoderViT(**TINY, mask_ratio=ratio))
    assert str(err.value) == (f"mask_ratio must be in (0, 1) (the loss counts masked patches only: at 0 it is 0 at "
                              f"every step), got {ratio}; for a plain autoencoder set loss_on_all_patches=true")


def test_a_plain_autoencoder_trains_on_every_patch():
    """``mask_ratio=0`` with ``loss_on_all_patches``: nothing masked, the loss is the MSE of every
    patch (hand-computed from the prediction), non-zero, and it has gradients."""
    torch.manual_seed(0)
    model = MaskedAutoencoder(MaskedAutoencoderViT(**TINY, mask_ratio=0.0, loss_on_all_patches=True, norm_pix_loss=False, zero_init_branches=False))
    images = torch.randn(3, 2, 16, 16)
    loss, pred, mask = model(images)
    assert mask.sum() == 0
    expected = ((pred - patchify(images, 4)) ** 2).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    assert loss > 0
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.network.encoder.parameters())
    with pytest.raises(ValueError, match=r"mask_ratio must be in \[0, 1\) with loss_on_all_patches, got 1.0"):
        MaskedAutoencoder(MaskedAutoencoderViT(**TINY, mask_ratio=1.0, loss_on_all_patches=True))


def test_loss_on_all_patches_with_masking_counts_the_visible_patches_too():
    torch.manual_seed(0)
    images = torch.randn(2, 2, 16, 16)
    plain = MaskedAutoencoder(MaskedAutoencoderViT(**TINY, norm_pix_loss=False, zero_init_branches=False))
    everywhere = MaskedAutoencoder(MaskedAutoencoderViT(**TINY, norm_pix_loss=False, zero_init_branches=False, loss_on_all_patches=True))
    everywhere.load_state_dict(plain.state_dict())
    masked_loss, pred, mask = plain(images, generator=torch.Generator().manual_seed(1))
    all_loss, pred_again, _ = everywhere(images, generator=torch.Generator().manual_seed(1))
    per_patch = ((pred - patchify(images, 4)) ** 2).mean(-1)
    torch.testing.assert_close(masked_loss, per_patch[mask.bool()].mean(), rtol=1e-6, atol=0)
    torch.testing.assert_close(all_loss, per_patch.mean(), rtol=1e-6, atol=0)


def test_the_decoder_cls_token_gets_its_gradient_in_the_layout_ddp_expects():
    """Its gradient is a slice of the concatenated tokens' (strides 17*D, D, 1), which DDP's reducer
    warns about at every multi-process fit; the hook gives the same values with a fresh tensor's strides."""
    torch.manual_seed(0)
    hooked = MaskedAutoencoder(MaskedAutoencoderViT(**TINY))
    plain = MaskedAutoencoder(MaskedAutoencoderViT(**TINY))
    plain.load_state_dict(hooked.state_dict())
    plain.network.decoder.cls_token = nn.Parameter(hooked.network.decoder.cls_token.detach().clone())  # a parameter without the hook
    images = torch.randn(2, 2, 16, 16)
    for model in (hooked, plain):
        model(images, generator=torch.Generator().manual_seed(0))[0].backward()
    got, sliced = hooked.network.decoder.cls_token.grad, plain.network.decoder.cls_token.grad
    assert sliced.stride() != got.stride() == torch.empty(got.shape).stride()
    assert torch.equal(got, sliced)
