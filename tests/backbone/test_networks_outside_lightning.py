"""docs/checkpoints.md ("timm by name"): the papers' two generative networks are plain ``nn.Module``s in timm's registry: the MAE
(encoder, skip decoder, masking, loss) and U-ViT build with ``timm.create_model`` after
``import lightning_mods.backbone``, take a plain PyTorch training step, and are, weight for
weight, the networks the LightningModules train (whose checkpoints they read)."""
from __future__ import annotations

import pytest
import timm
import torch
from lightning import LightningModule

import lightning_mods.backbone  # noqa: F401 (registers the networks)
from lightning_mods.backbone import shortcut_alphas
from lightning_mods.backbone.mae_weights import checkpoint_filter_fn
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from lightning_mods.backbone.uvit import UViT

SMALL_MAE = dict(depth=2, decoder_depth=1, embed_dim=32, num_heads=2, decoder_embed_dim=32, decoder_num_heads=2)


def plain_step(net: torch.nn.Module, loss_fn) -> tuple[float, float]:  # noqa: ANN001
    """One AdamW step of a plain PyTorch loop: the loss before, and after, on the same batch."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    before = loss_fn()
    before.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        return float(before), float(loss_fn())


def test_the_mae_builds_by_name_and_trains_in_a_plain_loop():
    torch.manual_seed(0)
    net = timm.create_model("mae_vit_tiny_patch4_32_decayed", alpha_min=0.6, **SMALL_MAE)
    assert type(net) is MaskedAutoencoderViT and not isinstance(net, LightningModule)
    images = torch.randn(4, 3, 32, 32)

    def loss():  # the same masks each time: the change is the step's
        return net(images, generator=torch.Generator().manual_seed(1))[0]
    before, after = plain_step(net, loss)
    assert after < before
    alphas = shortcut_alphas(net.encoder)  # linear from 1 to 0.6 over the 4 sub-layers
    assert alphas == pytest.approx([1.0, 0.8666666666666667, 0.7333333333333334, 0.6], abs=1e-6)


def test_the_registered_mae_is_the_lightning_module_s_network_weight_for_weight():
    from lightning_mods.mae import MaskedAutoencoder

    torch.manual_seed(0)
    module = MaskedAutoencoder(MaskedAutoencoderViT(img_size=32, patch_size=4, **SMALL_MAE))
    torch.manual_seed(0)
    net = timm.create_model("mae_vit_tiny_patch4_32_decayed", **SMALL_MAE)
    ours = module.network.state_dict()
    assert ours.keys() == net.state_dict().keys()
    for name, value in net.state_dict().items():
        assert torch.equal(value, ours[name]), name  # same initialisation, drawn in the same order
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(module(images, generator=torch.Generator().manual_seed(3))[0],
                               net(images, generator=torch.Generator().manual_seed(3))[0], rtol=0, atol=0)


def test_the_foreign_mae_names_map_to_the_network_s():
    """Without a network only the names change (both repositories', DDP's prefix and the file's
    ``model`` wrapper); a shortcutlab state_dict passes unchanged."""
    official = {"model": {"module.cls_token": 1, "module.blocks.0.attn.qkv.weight": 2, "module.norm.bias": 3,
                          "module.decoder_embed.weight": 4, "module.mask_token": 5, "module.decoder_pred.bias": 6}}
    assert checkpoint_filter_fn(official) == {
        "encoder.cls_token": 1, "encoder.blocks.0.attn.qkv.weight": 2, "encoder.norm.bias": 3,
        "decoder.embed.weight": 4, "decoder.mask_token": 5, "decoder.pred.bias": 6}
    authors = {"skip.1.fc.0.weight": 7, "skip.1.fc.2.bias": 8, "skip.1.mask_token": 9, "decoder_cls_token": 10}
    assert checkpoint_filter_fn(authors) == {"decoder.fusions.1.fc1.weight": 7, "decoder.fusions.1.fc2.bias": 8,
                                             "decoder.fusions.1.mask_token": 9, "decoder.cls_token": 10}
    net = MaskedAutoencoderViT(img_size=32, patch_size=4, unet_skips=False, encoder_final_norm=True,
                               decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, depth=2, embed_dim=32,
                               num_heads=2)
    ours = net.state_dict()
    assert checkpoint_filter_fn(ours, net) == ours


def test_u_vit_builds_by_name_and_trains_in_a_plain_loop():
    torch.manual_seed(0)
    net = timm.create_model("uvit_small_patch2_32_decayed", alpha_min=0.6, depth=2, embed_dim=32, num_heads=2,
                            img_size=8)
    assert type(net) is UViT
    x0, noise = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)
    t = torch.tensor([10, 200, 500, 900])

    def loss():  # epsilon prediction at fixed noise levels
        return torch.nn.functional.mse_loss(net(x0 + noise, t.float()), noise)
    before, after = plain_step(net, loss)
    assert after < before


def test_a_file_that_is_not_the_network_s_is_refused_in_one_line(tmp_path):
    net = timm.create_model("uvit_small_patch2_32_decayed", depth=2, embed_dim=32, num_heads=2, img_size=8)
    state = net.state_dict()
    del state["mid_block.mlp.fc2.weight"]
    torch.save(state, tmp_path / "uvit.pth")
    with pytest.raises(ValueError, match=r"leaves 1 weights at their initial value \(mid_block.mlp.fc2.weight\)"):
        timm.create_model("uvit_small_patch2_32_decayed", depth=2, embed_dim=32, num_heads=2, img_size=8,
                          pretrained=True, pretrained_cfg_overlay=dict(file=str(tmp_path / "uvit.pth")))
