"""U-ViT with decayed shortcuts (the decay paper, section 5): equals a U-ViT of stock timm blocks with the
`none` schedule, the schedule spans in -> mid -> out, skips are last in first out."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block
from torch import nn

from lightning_mods.backbone.residual import shortcut_alphas, timm_state_dict
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.uvit import UViT, timestep_embedding

TINY = dict(img_size=8, patch_size=2, in_chans=3, embed_dim=32, depth=4, num_heads=4)


def stock_block(decayed, dim: int, num_heads: int) -> Block:
    # U-ViT's norm is torch's LayerNorm (eps 1e-5), not timm's default (eps 1e-6)
    block = Block(dim, num_heads, mlp_ratio=4.0, qkv_bias=False, norm_layer=nn.LayerNorm)
    block.load_state_dict(timm_state_dict(decayed, force=True), strict=True)  # weights; alphas come by hand
    return block.eval()


def decayed(block: Block, a_attn: float, a_mlp: float):
    """A stock timm block's forward with shortcut weights: ``x <- a x + f(x)`` per sub-layer."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        x = a_attn * x + block.attn(block.norm1(x))
        return a_mlp * x + block.mlp(block.norm2(x))
    return forward


def reference_uvit(model: UViT, x: torch.Tensor, t: torch.Tensor, y=None, alphas=None) -> torch.Tensor:
    """Bao et al.'s forward, written out here with stock timm blocks carrying the same weights;
    ``alphas``: one shortcut weight per sub-layer in depth order in -> mid -> out (None: all 1)."""
    d, h = model.embed_dim, model.in_blocks[0].attn.num_heads
    stock = [stock_block(b, d, h) for b in [*model.in_blocks, model.mid_block, *model.out_blocks]]
    if alphas is not None:
        stock = [decayed(b, alphas[2 * i], alphas[2 * i + 1]) for i, b in enumerate(stock)]
    n_in = len(model.in_blocks)
    ins, mid, outs = stock[:n_in], stock[n_in], stock[n_in + 1:]
    # tokens as Bao et al. lay them out: [class,] time, patches; plus the position embedding
    time = model.time_embed(timestep_embedding(t, d))[:, None]
    proj = model.patch_embed.proj
    patch_tokens = F.conv2d(x, proj.weight, proj.bias, stride=model.patch_size).flatten(2).transpose(1, 2)
    prefix = [model.label_emb(y)[:, None], time] if model.num_classes else [time]
    tokens = torch.cat([*prefix, patch_tokens], dim=1) + model.pos_embed
    skips = []
    for blk in ins:
        tokens = blk(tokens)
        skips.append(tokens)
    tokens = mid(tokens)
    for fuse, blk in zip(model.skip_fusions, outs):
        tokens = blk(fuse(torch.cat([tokens, skips.pop()], dim=-1)))
    patches = model.head(model.norm(tokens))[:, model.num_prefix_tokens:]
    b, n, _ = patches.shape
    g, p, c = int(math.isqrt(n)), model.patch_size, model.in_chans
    # 'B (h w) (p1 p2 C) -> B C (h p1) (w p2)'
    image = patches.reshape(b, g, g, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, g * p, g * p)
    return model.final_layer(image)


def test_timestep_embedding_matches_float64_reference():
    t = np.array([0, 1, 17, 500, 999], dtype=np.float64)
    for dim in (32, 33):
        half = dim // 2
        freqs = np.exp(-math.log(10000.0) * np.arange(half) / half)
        args = t[:, None] * freqs[None]
        expected = np.concatenate([np.cos(args), np.sin(args)] + ([np.zeros((5, 1))] if dim % 2 else []), axis=1)
        got = timestep_embedding(torch.tensor(t, dtype=torch.long), dim).double().numpy()
        np.testing.assert_allclose(got, expected, atol=2e-4, rtol=0)  # float32 angles up to ~1e3 rad


@pytest.mark.parametrize("num_classes,final_conv", [(0, True), (5, True), (0, False)])
def test_none_schedule_equals_stock_timm_uvit(num_classes, final_conv):
    torch.manual_seed(0)
    model = UViT(**TINY, num_classes=num_classes, final_conv=final_conv, shortcut=ShortcutSchedule("none")).eval()
    x, t = torch.randn(3, 3, 8, 8), torch.tensor([0, 10, 999])
    y = torch.tensor([0, 4, 5]) if num_classes else None  # 5 = the null class
    with torch.no_grad():
        diff = (model(x, t, y) - reference_uvit(model, x, t, y)).abs().max().item()
    assert diff == 0.0


def test_decayed_schedule_changes_the_output():
    torch.manual_seed(0)
    model = UViT(**TINY, shortcut=ShortcutSchedule("linear", 0.6), zero_init_branches=False).eval()
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([3, 300])
    alphas = [1.0 - k / 9 * 0.4 for k in range(10)]  # 5 blocks x 2 sub-layers, in -> mid -> out, by hand
    with torch.no_grad():
        out = model(x, t)
        assert (out - reference_uvit(model, x, t)).abs().max().item() > 1e-3
        torch.testing.assert_close(out, reference_uvit(model, x, t, alphas=alphas), rtol=1e-5, atol=1e-6)


def test_schedule_runs_over_in_mid_and_out_blocks_in_depth_order():
    model = UViT(**{**TINY, "depth": 6}, shortcut=ShortcutSchedule("linear", 0.6))
    assert model.num_blocks == 7 and model.num_sublayers == 14
    expected = [1.0 - k / 13 * 0.4 for k in range(14)]
    np.testing.assert_allclose(shortcut_alphas(model), expected, rtol=0, atol=1e-12)
    mid_k = 2 * len(model.in_blocks)
    assert model.mid_block.shortcut_weight(0) == pytest.approx(expected[mid_k])
    assert model.out_blocks[-1].shortcut_weight(1) == 0.6  # exactly alpha_min at the very last sub-layer


def test_skips_are_last_in_first_out():
    torch.manual_seed(0)
    model = UViT(**{**TINY, "depth": 6}).eval()
    in_outputs, fusion_inputs = [], []
    for blk in model.in_blocks:
        blk.register_forward_hook(lambda m, i, o: in_outputs.append(o))
    for fuse in model.skip_fusions:
        fuse.register_forward_hook(lambda m, i, o: fusion_inputs.append(i[0]))
    with torch.no_grad():
        model(torch.randn(2, 3, 8, 8), torch.tensor([1, 2]))
    assert len(fusion_inputs) == 3
    for i, fused in enumerate(fusion_inputs):
        torch.testing.assert_close(fused[..., 32:], in_outputs[-1 - i], rtol=0, atol=0)


def test_zero_init_zeroes_every_branch_output_layer():
    model = UViT(**TINY, zero_init_branches=True)
    for blk in model.blocks_in_depth_order():
        assert torch.count_nonzero(blk.attn.proj.weight) == 0 and torch.count_nonzero(blk.mlp.fc2.weight) == 0
    assert torch.count_nonzero(model.head.weight) > 0


def test_forward_blocks_returns_prefixes_of_the_full_run():
    torch.manual_seed(0)
    model = UViT(**TINY, num_classes=3).eval()
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([5, 50])
    with torch.no_grad():
        full = model.forward_blocks(x, t)
        part = model.forward_blocks(x, t, num_blocks=3)
        assert len(full) == model.num_blocks == 5 and len(part) == 3
        for a, b in zip(part, full):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # y=None is the null class
        torch.testing.assert_close(model(x, t), model(x, t, torch.tensor([3, 3])), rtol=0, atol=0)


def test_bad_arguments_raise_one_line_errors():
    with pytest.raises(ValueError, match="patch_size"):
        UViT(img_size=9, patch_size=2)
    with pytest.raises(ValueError, match="num_heads"):
        UViT(embed_dim=30, num_heads=4)
    with pytest.raises(ValueError, match="num_classes"):
        UViT(**TINY, num_classes=-1)
    with pytest.raises(ValueError, match="unconditional"):
        UViT(**TINY)(torch.zeros(1, 3, 8, 8), torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="num_blocks"):
        UViT(**TINY).forward_blocks(torch.zeros(1, 3, 8, 8), torch.tensor([1]), num_blocks=9)
