"""Decayed ViT and ResNet backbones against stock timm (the decay paper, section 3.1 and appendix B.2)."""
import numpy as np
import pytest
import torch
from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from timm.models.vision_transformer import VisionTransformer

from lightning_mods.backbone.residual import residual_blocks, shortcut_alphas, timm_state_dict
from lightning_mods.backbone.resnet import DecayedResNet, ResNet18Cifar, ResNet50, ResNet50d
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.vit import DecayedBlock, DecayedVisionTransformer
from helpers.reference_stems import reference_cifar_stem

VIT = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, num_classes=5)


def assert_timm_keys_plus_shortcut_entries(ours, stock):
    """Our state_dict is timm's, key for key and in order, plus one ``shortcut_weights`` per block."""
    keys = list(ours.state_dict())
    blocks = [name for name, m in ours.named_modules() if m in residual_blocks(ours)]
    assert [k for k in keys if not k.endswith(".shortcut_weights")] == list(stock.state_dict())
    assert [k for k in keys if k.endswith(".shortcut_weights")] == [f"{b}.shortcut_weights" for b in blocks]


def small_resnet_kwargs():
    return dict(num_classes=7, in_chans=3)


@pytest.mark.parametrize("shortcut", [ShortcutSchedule("none"), ShortcutSchedule("linear", 1.0),
                                      ShortcutSchedule("cosine", 1.0)])
def test_vit_equals_timm_at_alpha_one(shortcut):
    torch.manual_seed(0)
    ours = DecayedVisionTransformer(shortcut=shortcut, zero_init_branches=False, **VIT).eval()
    stock = VisionTransformer(**VIT).eval()
    assert_timm_keys_plus_shortcut_entries(ours, stock)
    stock.load_state_dict(timm_state_dict(ours))  # strict both ways
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert (ours(x) - stock(x)).abs().max().item() == 0.0
        assert (ours.forward_features(x) - stock.forward_features(x)).abs().max().item() == 0.0
        a = ours.forward_intermediates(x, intermediates_only=True)
        b = stock.forward_intermediates(x, intermediates_only=True)
        assert all((u - v).abs().max().item() == 0.0 for u, v in zip(a, b))


def stock_resnet(block, layers, cifar=False, **kw):
    model = ResNet(block=block, layers=layers, **kw)
    return reference_cifar_stem(model, kw.get("in_chans", 3)) if cifar else model


@pytest.mark.parametrize("build,stock", [
    (lambda: ResNet18Cifar(zero_init_branches=False, **small_resnet_kwargs()),
     lambda: stock_resnet(BasicBlock, (2, 2, 2, 2), cifar=True, **small_resnet_kwargs())),
    (lambda: ResNet50(shortcut=ShortcutSchedule("linear", 1.0), zero_init_branches=False, **small_resnet_kwargs()),
     lambda: stock_resnet(Bottleneck, (3, 4, 6, 3), **small_resnet_kwargs())),
    (lambda: ResNet50d(zero_init_branches=False, **small_resnet_kwargs()),
     lambda: stock_resnet(Bottleneck, (3, 4, 6, 3), stem_width=32, stem_type="deep", avg_down=True,
                          **small_resnet_kwargs())),
], ids=["resnet18_cifar", "resnet50", "resnet50d"])
def test_resnet_equals_timm_at_alpha_one(build, stock):
    torch.manual_seed(0)
    ours, ref = build(), stock()
    assert_timm_keys_plus_shortcut_entries(ours, ref)
    ref.load_state_dict(timm_state_dict(ours))
    ours.load_state_dict(ref.state_dict())
    # non-trivial BN statistics so the comparison covers them
    for m in list(ours.modules()):
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    ref.load_state_dict(timm_state_dict(ours))
    ours.eval(), ref.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() == 0.0


def hand_vit_forward(model, x, alphas):
    """Decayed ViT forward written out from timm's submodules and float alphas."""
    h = model._pos_embed(model.patch_embed(x))
    h = model.norm_pre(model.patch_drop(h))
    for i, blk in enumerate(model.blocks):
        h = alphas[2 * i] * h + blk.attn(blk.norm1(h))
        h = alphas[2 * i + 1] * h + blk.mlp(blk.norm2(h))
    return model.forward_head(model.norm(h))


def test_vit_decayed_forward_matches_hand_computation():
    torch.manual_seed(1)
    model = DecayedVisionTransformer(shortcut=ShortcutSchedule("linear", 0.5), zero_init_branches=False, **VIT).eval()
    alphas = list(1.0 - np.arange(6) / 5 * 0.5)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hand_vit_forward(model, x, alphas), rtol=0, atol=1e-6)
    assert model.num_sublayers == 6
    assert shortcut_alphas(model) == pytest.approx(alphas, abs=1e-15)


def test_resnet_decay_reaches_projection_shortcuts_in_depth_order():
    model = ResNet18Cifar(num_blocks=8, shortcut=ShortcutSchedule("linear", 0.3), num_classes=10)
    blocks = residual_blocks(model)
    assert len(blocks) == 8 and model.num_sublayers == 8
    expected = 1.0 - np.arange(8) / 7 * 0.7
    np.testing.assert_allclose(shortcut_alphas(model), expected, atol=1e-15)
    # the first block of stages 2..4 has a projection shortcut and is scaled too
    assert blocks[2].downsample is not None and shortcut_alphas(model)[2] == pytest.approx(expected[2])
    torch.manual_seed(0)
    x = torch.randn(2, 64, 16, 16)
    blk = model.layer2[0].eval()
    with torch.no_grad():
        want = torch.relu(expected[2] * blk.downsample(x) + blk.bn2(blk.conv2(blk.act1(blk.bn1(blk.conv1(x))))))
        torch.testing.assert_close(blk(x), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("total", [8, 12, 16])
def test_deeper_resnet18_variants(total):
    model = ResNet18Cifar(num_blocks=total, num_classes=10)
    assert len(residual_blocks(model)) == total
    assert len(model.layer3) == 2 + total - 8


def test_every_parameter_gets_a_gradient():
    for model in (DecayedVisionTransformer(shortcut=ShortcutSchedule("learnable"), zero_init_branches=False, **VIT),
                  ResNet18Cifar(shortcut=ShortcutSchedule("learnable"), zero_init_branches=False, num_classes=5)):
        torch.manual_seed(0)
        model.train()
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            assert p.grad.abs().sum() > 0, name


def test_learnable_alphas_change_after_a_step():
    torch.manual_seed(0)
    model = DecayedVisionTransformer(shortcut=ShortcutSchedule("learnable"), zero_init_branches=False, **VIT)
    alpha_names = [n for n, _ in model.named_parameters() if "alpha" in n]
    assert len(alpha_names) == 2 * VIT["depth"]
    before = shortcut_alphas(model)
    assert before == [1.0] * 6
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 3])).backward()
    opt.step()
    after = shortcut_alphas(model)
    assert all(a != b for a, b in zip(after, before))


def test_learnable_only_on_decayed_branch():
    model = DecayedVisionTransformer(shortcut=ShortcutSchedule("learnable", branches="mlp"), **VIT)
    names = [n for n, _ in model.named_parameters() if "alpha" in n]
    assert names == [f"blocks.{i}.alpha_mlp" for i in range(VIT["depth"])]


def test_zero_init_makes_every_branch_output_zero():
    torch.manual_seed(0)
    vit = DecayedVisionTransformer(shortcut=ShortcutSchedule("linear", 0.6), **VIT)
    x = torch.randn(2, 17, VIT["embed_dim"])
    for blk in vit.blocks:
        assert isinstance(blk, DecayedBlock)
        assert blk.attn_branch(x).abs().max().item() == 0.0
        assert blk.mlp_branch(x).abs().max().item() == 0.0
    resnet = ResNet50(num_classes=3).train()
    feats = {}
    for i, blk in enumerate(residual_blocks(resnet)):
        blk.register_forward_hook(lambda m, inp, out, i=i: feats.__setitem__(i, m.branch(inp[0])))
    resnet(torch.randn(2, 3, 64, 64))
    assert len(feats) == 16 and all(v.abs().max().item() == 0.0 for v in feats.values())


def test_zero_init_off_keeps_branches_alive():
    vit = DecayedVisionTransformer(zero_init_branches=False, **VIT)
    assert vit.blocks[0].attn.proj.weight.abs().sum() > 0


def test_block_fn_cannot_be_overridden():
    with pytest.raises(ValueError, match="block_fn"):
        DecayedVisionTransformer(block_fn=DecayedBlock, **VIT)


def test_resnet_rejects_bad_layers():
    with pytest.raises(ValueError, match="layers"):
        DecayedResNet(BasicBlock, (2, 0, 2, 2))
    with pytest.raises(ValueError, match="total_blocks"):
        ResNet18Cifar(num_blocks=6)


def test_resnet_accepts_dotted_layer_paths_from_saved_configs():
    """LightningCLI writes class defaults as 'torch.nn.ReLU'; reading the config back must work."""
    model = ResNet18Cifar(num_classes=3, act_layer="torch.nn.ReLU", norm_layer="torch.nn.BatchNorm2d")
    assert isinstance(model.layer1[0].act1, torch.nn.ReLU)
    assert isinstance(model.layer1[0].bn1, torch.nn.BatchNorm2d)
    with pytest.raises(ValueError, match="torch.nn.NoSuchLayer"):
        ResNet18Cifar(num_classes=3, act_layer="torch.nn.NoSuchLayer")


@pytest.mark.parametrize("cls,timm_name", [(ResNet18Cifar, None), (ResNet50, "resnet50"),
                                           (ResNet50d, "resnet50d")])
@pytest.mark.parametrize("zero_flag", ["zero_init_branches", "zero_init_last"])
def test_resnet_built_like_the_cli_matches_timm(cls, timm_name, zero_flag):
    """LightningCLI fills every timm kwarg with timm's default; the architecture must survive
    that (ResNet-D keeps its deep stem) and either zero-init flag must switch zero-init off."""
    import timm
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(cls, "model")
    cfg = parser.parse_args([f"--model.{zero_flag}=false", "--model.num_classes=3"])
    model = parser.instantiate(cfg).model
    if timm_name is not None:
        ref = timm.create_model(timm_name, pretrained=False, num_classes=3)
        assert {k: v.shape for k, v in timm_state_dict(model).items()} == \
               {k: v.shape for k, v in ref.state_dict().items()}
    last_bn = [m.bn3 if hasattr(m, "bn3") else m.bn2 for m in residual_blocks(model)]
    assert all(bn.weight.abs().min().item() > 0 for bn in last_bn)


@pytest.mark.parametrize("depth", [0, -1])
def test_vit_depth_must_be_positive(depth):
    with pytest.raises(ValueError, match="depth must be a positive integer") as err:
        DecayedVisionTransformer(**{**VIT, "depth": depth})
    assert "\n" not in str(err.value)


class AtenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten operators run inside it (one per elementwise kernel here)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("learnable", [False, True])
def test_decayed_sum_is_one_kernel_and_equals_float64_math(learnable):
    """``a * x + f(x)`` at a != 1 is a single fused operator, within float32
    rounding of the float64 sum; a = 1 stays the plain ``x + f(x)``."""
    block = DecayedBlock(dim=8, num_heads=2)
    block.set_shortcut_weights([(0.6, 1.0), (1.0, 1.0)], [learnable, False])
    x, branch = torch.randn(2, 3, 8, dtype=torch.float32), torch.randn(2, 3, 8, dtype=torch.float32)
    with AtenOps() as decayed:
        out = block.residual(0, x, branch)
    with AtenOps() as standard:
        plain = block.residual(1, x, branch)
    assert len(decayed.ops) == 1, decayed.ops
    assert decayed.ops == (["aten.addcmul"] if learnable else ["aten.add"])
    want = 0.6 * x.double().numpy() + branch.double().numpy()
    np.testing.assert_allclose(out.detach().double().numpy(), want, rtol=0, atol=4 * np.finfo(np.float32).eps * 3)
    assert standard.ops == ["aten.add"] and torch.equal(plain, x + branch)


@pytest.mark.parametrize("learnable", [False, True])
def test_inplace_sum_writes_into_the_branch_with_the_same_values(learnable):
    """``inplace=True`` (the ResNet blocks, as timm's ``x += shortcut``) is one in-place kernel
    into the branch, bit-identical to the out-of-place sum."""
    block = DecayedBlock(dim=8, num_heads=2)
    block.set_shortcut_weights([(0.6, 1.0), (1.0, 1.0)], [learnable, False])
    x, branch = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    want_decayed, want_plain = block.residual(0, x, branch.clone()), block.residual(1, x, branch.clone())
    for j, want, op in ((0, want_decayed, "aten.addcmul_" if learnable else "aten.add_"), (1, want_plain, "aten.add_")):
        target = branch.clone()
        with AtenOps() as ops:
            out = block.residual(j, x, target, inplace=True)
        assert ops.ops == [op] and out.data_ptr() == target.data_ptr()
        assert torch.equal(out, want)


def test_inplace_sum_stays_out_of_place_where_the_branch_is_not_ours_alone():
    """A branch hook may keep the branch, and a bf16 branch plus a float32 shortcut is float32:
    both keep the out-of-place sum."""
    block = DecayedBlock(dim=8, num_heads=2)
    block.set_shortcut_weights([(0.6, 1.0), (1.0, 1.0)], [False, False])
    x, branch = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    kept = []
    block.branch_hook = lambda blk, j, b: kept.append(b) or b
    before = branch.clone()
    out = block.residual(0, x, branch, inplace=True)
    assert torch.equal(kept[0], before) and out.data_ptr() != branch.data_ptr()
    block.branch_hook = None
    low = branch.bfloat16()
    mixed = block.residual(0, x, low, inplace=True)
    assert mixed.dtype == torch.float32 and torch.equal(low, branch.bfloat16())


def test_resnet_training_step_equals_timm_at_alpha_one():
    """Train mode, forward and backward: with the in-place sum every gradient equals timm's bit
    for bit (batch statistics, ReLU after the sum, the downsampling shortcuts)."""
    torch.manual_seed(0)
    ours = ResNet18Cifar(shortcut=ShortcutSchedule("linear", 1.0), zero_init_branches=False, num_classes=5)
    ref = stock_resnet(BasicBlock, (2, 2, 2, 2), cifar=True, num_classes=5)
    ref.load_state_dict(timm_state_dict(ours))
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    for model in (ours, ref):
        model.train()
        torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = {name: p.grad for name, p in ref.named_parameters()}
    for name, p in ours.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
