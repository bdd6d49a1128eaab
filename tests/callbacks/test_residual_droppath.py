"""ResidualDroppath callback (the ResidualDroppath paper, section 3) against hand-computed float64 references.

The references below never call the callback's masking code: they re-implement the residual
MLP from its weights (zero-padded input, ``x + GELU(W x + c)`` per layer, linear head) and
apply the masks sample by sample with Python branches.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from callbacks.training.residual_droppath import ResidualDroppath
from datamodules.spiral import Spiral
from lightning_mods.backbone.residual import residual_blocks
from lightning_mods.spiral_classifier import SpiralClassifier
from lightning_mods.backbone.residual_mlp import ResidualMLP
from lightning_mods.backbone.resnet import ResNet18Cifar
from lightning_mods.backbone.vit import DecayedVisionTransformer

WIDTH = 4


def fake_trainer(step: int, rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, global_rank=rank)


def two_block_net(seed: int = 0) -> ResidualMLP:
    torch.manual_seed(seed)
    net = ResidualMLP(depth=2, width=WIDTH)
    with torch.no_grad():  # larger weights than the default init, so every GELU is far from linear
        for p in net.parameters():
            p.mul_(2.0)
    return net


def start_step(cb: ResidualDroppath, net: nn.Module, step: int, rank: int = 0) -> None:
    cb.on_train_batch_start(fake_trainer(step, rank), net, None, 0)


def end_step(cb: ResidualDroppath, net: nn.Module, step: int, rank: int = 0) -> None:
    cb.on_train_batch_end(fake_trainer(step, rank), net, None, None, 0)


def gelu64(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def params64(net: ResidualMLP) -> dict[str, torch.Tensor]:
    return {name: p.detach().double().clone().requires_grad_(True) for name, p in net.named_parameters()}


def hand_masked_forward(p: dict, points: torch.Tensor, keep: list[torch.Tensor]) -> torch.Tensor:
    """Even step by hand: ``h <- h + GELU(W h + c) * keep_k`` per layer, float64."""
    h = torch.cat([points.double(), torch.zeros(len(points), WIDTH - 2, dtype=torch.float64)], dim=1)
    for k, bits in enumerate(keep):
        f = gelu64(h @ p[f"layers.{k}.fc.weight"].T + p[f"layers.{k}.fc.bias"])
        h = h + f * bits.double()[:, None]
    return h @ p["head.weight"].T + p["head.bias"]


def hand_odd_gradients(p: dict, points: torch.Tensor, labels: torch.Tensor, keep: list[torch.Tensor]) -> dict:
    """Odd step by hand, one sample at a time: a layer's branch is live for the samples it
    dropped at the even step and a frozen constant for those it kept; mean cross-entropy."""
    n = len(points)
    total = torch.zeros((), dtype=torch.float64)
    for s in range(n):
        h = torch.cat([points[s].double(), torch.zeros(WIDTH - 2, dtype=torch.float64)])[None]
        for k, bits in enumerate(keep):
            f = gelu64(h @ p[f"layers.{k}.fc.weight"].T + p[f"layers.{k}.fc.bias"])
            h = h + (f.detach() if bool(bits[s]) else f)
        logits = h @ p["head.weight"].T + p["head.bias"]
        total = total - torch.log_softmax(logits, dim=1)[0, labels[s]]
    grads = torch.autograd.grad(total / n, list(p.values()), allow_unused=True)
    return {name: (torch.zeros_like(v) if g is None else g) for (name, v), g in zip(p.items(), grads)}


def layer_keys(depth: int = 2) -> list[str]:
    return [f"{k}.0" for k in range(depth)]


# --- even and odd steps ---------------------------------------------------------------------
def test_even_step_is_the_masked_residual_sum_without_rescaling():
    net = two_block_net()
    cb = ResidualDroppath(drop_rate=0.5, seed=11)
    cb.setup(fake_trainer(0), net, "fit")
    points = torch.rand(16, 2) * 2 - 1
    start_step(cb, net, 0)
    assert cb.phase == "drop"
    out = net(points)
    end_step(cb, net, 0)
    keep = [cb.masks[0][key] for key in layer_keys()]
    assert all(bits.dtype == torch.bool and bits.shape == (16,) for bits in keep)
    assert all(0 < int(bits.sum()) < 16 for bits in keep), "seed should give both kept and dropped samples"
    expected = hand_masked_forward(params64(net), points, keep)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    plain = hand_masked_forward(params64(net), points, [torch.ones(16, dtype=torch.bool)] * 2)
    assert (out.double() - plain).abs().max() > 1e-3  # the masks really changed the output


def test_masks_are_drawn_at_the_drop_rate():
    net = two_block_net()
    cb = ResidualDroppath(drop_rate=0.1, seed=0)
    cb.setup(fake_trainer(0), net, "fit")
    start_step(cb, net, 0)
    net(torch.zeros(20000, 2))
    end_step(cb, net, 0)
    for key in layer_keys():
        dropped = 1.0 - cb.masks[0][key].double().mean().item()
        assert abs(dropped - 0.1) < 0.01  # 5 standard deviations at n = 20000
    assert not torch.equal(cb.masks[0]["0.0"], cb.masks[0]["1.0"])


def run_even_then_odd(drop_rate=0.5, n_even=12, n_odd=12, seed=5, masks=None):
    """Even step on ``n_even`` samples (or load ``masks`` as if drawn at step 0), then the odd
    step on ``n_odd`` new samples with a backward pass; returns what the test needs."""
    net = two_block_net(seed)
    cb = ResidualDroppath(drop_rate=drop_rate, seed=seed)
    cb.setup(fake_trainer(0), net, "fit")
    if masks is None:
        start_step(cb, net, 0)
        net(torch.rand(n_even, 2) * 2 - 1)
        end_step(cb, net, 0)
    else:
        cb.load_state_dict({"drop_rate": drop_rate, "seed": seed, "masks_step": 0, "masks": [masks]})
    stored = {key: bits.clone() for key, bits in cb.masks[0].items()}
    gen = torch.Generator().manual_seed(seed + 100)
    points = torch.rand(n_odd, 2, generator=gen) * 2 - 1
    labels = torch.randint(0, 2, (n_odd,), generator=gen)
    start_step(cb, net, 1)
    assert cb.phase == "reuse"
    out = net(points)
    F.cross_entropy(out, labels).backward()
    used = [cb.current_masks[key][:n_odd].clone() for key in layer_keys()]  # a batch uses the first B bits
    end_step(cb, net, 1)
    return SimpleNamespace(net=net, cb=cb, stored=stored, points=points, labels=labels, out=out, used=used)


def test_odd_step_forward_is_the_plain_network_and_gradients_come_from_dropped_samples():
    r = run_even_then_odd()
    assert [torch.equal(u, r.stored[k]) for u, k in zip(r.used, layer_keys())] == [True, True]
    with torch.no_grad():
        assert torch.equal(r.out, r.net(r.points))  # hooks gone: bit-identical to the plain forward
    p = params64(r.net)
    plain = hand_masked_forward(p, r.points, [torch.ones(len(r.points), dtype=torch.bool)] * 2)
    torch.testing.assert_close(r.out.double(), plain, rtol=1e-5, atol=1e-6)
    expected = hand_odd_gradients(p, r.points, r.labels, r.used)
    for name, param in r.net.named_parameters():
        torch.testing.assert_close(param.grad.double(), expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_last_layer_gradient_is_the_plain_gradient_of_the_dropped_samples_only():
    r = run_even_then_odd()
    dropped = ~r.used[1]
    assert 0 < int(dropped.sum()) < len(dropped)
    p = params64(r.net)
    logits = hand_masked_forward(p, r.points[dropped], [torch.ones(int(dropped.sum()), dtype=torch.bool)] * 2)
    loss = F.cross_entropy(logits, r.labels[dropped], reduction="sum") / len(r.points)
    w, b = torch.autograd.grad(loss, [p["layers.1.fc.weight"], p["layers.1.fc.bias"]])
    torch.testing.assert_close(r.net.layers[1].fc.weight.grad.double(), w, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(r.net.layers[1].fc.bias.grad.double(), b, rtol=1e-4, atol=1e-6)


def test_block_kept_for_every_sample_gets_zero_gradient_not_none():
    """What keeps DDP from waiting: the branch stays in the graph with a zero weight."""
    n = 8
    masks = {"0.0": torch.ones(n, dtype=torch.bool), "1.0": torch.tensor([0, 1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)}
    r = run_even_then_odd(masks=masks, n_odd=n)
    for param in r.net.layers[0].parameters():
        assert param.grad is not None and param.grad.abs().max().item() == 0.0
    assert r.net.layers[1].fc.weight.grad.abs().max().item() > 0.0


def test_even_step_with_every_sample_dropped_keeps_zero_gradients():
    net = two_block_net()
    cb = ResidualDroppath(drop_rate=0.999999, seed=0)
    cb.setup(fake_trainer(0), net, "fit")
    start_step(cb, net, 0)
    net(torch.rand(6, 2)).sum().backward()
    end_step(cb, net, 0)
    assert not any(bits.any() for bits in cb.masks[0].values())
    for layer in net.layers:
        assert layer.fc.weight.grad is not None and layer.fc.weight.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("n_odd", [5, 12])
def test_odd_batch_of_another_size_slices_or_extends_the_masks(n_odd):
    r = run_even_then_odd(n_even=8, n_odd=n_odd)
    for key, used in zip(layer_keys(), r.used):
        assert used.shape == (n_odd,)
        common = min(8, n_odd)
        assert torch.equal(used[:common], r.stored[key][:common])
    assert all(bits.shape == (8,) for bits in r.cb.masks[0].values())  # extensions are not stored
    expected = hand_odd_gradients(params64(r.net), r.points, r.labels, r.used)
    for name, param in r.net.named_parameters():
        torch.testing.assert_close(param.grad.double(), expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_odd_step_without_masks_from_the_step_before_draws_fresh_ones():
    net = two_block_net()
    cb = ResidualDroppath(drop_rate=0.5, seed=2)
    cb.setup(fake_trainer(0), net, "fit")
    cb.load_state_dict({"drop_rate": 0.5, "seed": 2, "masks_step": 4,
                        "masks": [{"0.0": torch.ones(6, dtype=torch.bool), "1.0": torch.ones(6, dtype=torch.bool)}]})
    start_step(cb, net, 7)  # masks are from step 4, not 6
    net(torch.rand(6, 2))
    used = dict(cb.current_masks)
    end_step(cb, net, 7)
    assert not all(bool(bits.all()) for bits in used.values())


def test_masks_differ_between_ranks_and_a_resumed_rank_replays_its_own():
    net = two_block_net()
    drawn = {}
    for rank in (0, 1):
        cb = ResidualDroppath(drop_rate=0.5, seed=9)
        cb.setup(fake_trainer(0, rank), net, "fit")
        start_step(cb, net, 0, rank)
        net(torch.rand(32, 2))
        end_step(cb, net, 0, rank)
        drawn[rank] = cb
    assert not torch.equal(drawn[0].masks[0]["0.0"], drawn[1].masks[0]["0.0"])
    saved = drawn[0].state_dict()  # only rank 0 writes checkpoints
    for rank in (0, 1):
        resumed = ResidualDroppath(drop_rate=0.5, seed=9)
        resumed.setup(fake_trainer(1, rank), net, "fit")
        resumed.load_state_dict(saved)
        start_step(resumed, net, 1, rank)
        net(torch.rand(32, 2))
        for key in layer_keys():
            assert torch.equal(resumed.current_masks[key].cpu(), drawn[rank].masks[0][key].cpu())
        end_step(resumed, net, 1, rank)


def test_without_a_seed_every_rank_takes_rank_zeros_initial_seed():
    """``ddp`` relaunches the script per rank, so without ``seed_everything`` each process has its
    own ``torch.initial_seed()``; a checkpoint keeps rank 0's, so every rank must draw from it."""
    net = two_block_net()
    sent = []

    def broadcast(obj, src=0):  # what rank 1 receives: rank 0's value, not its own
        sent.append((obj, src))
        return 12345

    cb = ResidualDroppath(drop_rate=0.5)
    torch.manual_seed(777)  # this "rank"'s own seed
    cb.setup(fake_trainer(0, 1), net, "fit")
    cb.on_train_start(SimpleNamespace(strategy=SimpleNamespace(broadcast=broadcast)), net)
    start_step(cb, net, 0, 1)
    net(torch.rand(8, 2))
    end_step(cb, net, 0, 1)
    assert sent == [(777, 0)] and cb.state_dict()["seed"] == 12345


def test_a_second_call_in_the_same_micro_batch_reuses_the_masks():
    net = two_block_net()
    cb = ResidualDroppath(drop_rate=0.5, seed=4)
    cb.setup(fake_trainer(0), net, "fit")
    points = torch.rand(10, 2)
    start_step(cb, net, 0)
    first, second = net(points), net(points)  # e.g. activation-checkpointing recomputation
    end_step(cb, net, 0)
    assert torch.equal(first, second)
    assert all(blk.branch_hook is None for blk in residual_blocks(net))


def test_eval_mode_forward_inside_a_training_batch_is_plain():
    net = two_block_net()
    cb = ResidualDroppath(drop_rate=0.5, seed=4)
    cb.setup(fake_trainer(0), net, "fit")
    points = torch.rand(10, 2)
    with torch.no_grad():
        plain = net(points)
    start_step(cb, net, 0)
    net.eval()  # e.g. an online probe's extra forward
    with torch.no_grad():
        probe = net(points)
    net.train()
    masked = net(points)
    end_step(cb, net, 0)
    assert torch.equal(probe, plain) and not torch.equal(masked, plain)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="drop_rate"):
        ResidualDroppath(drop_rate=1.0)
    with pytest.raises(ValueError, match="drop_rate"):
        ResidualDroppath(drop_rate=-0.1)
    with pytest.raises(ValueError, match="seed"):
        ResidualDroppath(seed=-1)
    with pytest.raises(ValueError, match="no DecayedResidual blocks"):
        ResidualDroppath().setup(fake_trainer(0), nn.Linear(2, 2), "fit")


# --- other residual blocks ------------------------------------------------------------------
def test_vit_attention_and_mlp_sub_layers_are_masked_separately():
    torch.manual_seed(0)
    vit = DecayedVisionTransformer(img_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2, num_classes=3,
                                   zero_init_branches=False)
    cb = ResidualDroppath(drop_rate=0.5, seed=1)
    cb.setup(fake_trainer(0), vit, "fit")
    images = torch.randn(6, 3, 8, 8)
    start_step(cb, vit, 0)
    out = vit(images)
    end_step(cb, vit, 0)
    assert sorted(cb.masks[0]) == ["0.0", "0.1", "1.0", "1.1"]
    keep = {key: bits.float()[:, None, None] for key, bits in cb.masks[0].items()}
    with torch.no_grad():  # hand forward from timm's sub-modules
        h = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(images))))
        for i, blk in enumerate(vit.blocks):
            h = h + blk.attn(blk.norm1(h)) * keep[f"{i}.0"]
            h = h + blk.mlp(blk.norm2(h)) * keep[f"{i}.1"]
        expected = vit.forward_head(vit.norm(h))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_resnet_blocks_are_masked_before_the_activation():
    torch.manual_seed(0)
    net = ResNet18Cifar(channels=(4, 8, 8, 8), num_classes=3, zero_init_branches=False)  # train mode: batch stats
    cb = ResidualDroppath(drop_rate=0.5, seed=3)
    cb.setup(fake_trainer(0), net, "fit")
    images = torch.randn(5, 3, 8, 8)
    start_step(cb, net, 0)
    out = net(images)
    end_step(cb, net, 0)
    blocks = residual_blocks(net)
    assert sorted(cb.masks[0], key=lambda k: int(k.split(".")[0])) == [f"{i}.0" for i in range(len(blocks))]
    with torch.no_grad():
        h = net.maxpool(net.act1(net.bn1(net.conv1(images))))
        for i, blk in enumerate(blocks):
            shortcut = h if blk.downsample is None else blk.downsample(h)
            branch = blk.bn2(blk.conv2(blk.act1(blk.bn1(blk.conv1(h)))))
            h = torch.relu(shortcut + branch * cb.masks[0][f"{i}.0"].float()[:, None, None, None])
        expected = net.fc(h.mean(dim=(2, 3)))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_vit_odd_step_is_the_plain_forward_and_grads_come_from_dropped_samples_only():
    torch.manual_seed(0)
    vit = DecayedVisionTransformer(img_size=8, patch_size=4, embed_dim=8, depth=2, num_heads=2, num_classes=3,
                                   zero_init_branches=False).double()
    cb = ResidualDroppath(drop_rate=0.5, seed=5)
    cb.setup(fake_trainer(0), vit, "fit")
    images, labels = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.randint(0, 3, (6,))
    start_step(cb, vit, 0)
    vit(images)
    end_step(cb, vit, 0)
    start_step(cb, vit, 1)
    out = vit(images)
    F.cross_entropy(out, labels).backward()
    end_step(cb, vit, 1)
    got = {name: p.grad.clone() for name, p in vit.named_parameters()}
    vit.zero_grad()
    keep = cb.masks[0]

    def by_hand(h: torch.Tensor, f: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        # sample by sample: a branch kept at the even step is a constant now
        return h + torch.stack([f[s].detach() if bool(bits[s]) else f[s] for s in range(len(f))])

    h = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(images))))
    for i, blk in enumerate(vit.blocks):
        h = by_hand(h, blk.attn(blk.norm1(h)), keep[f"{i}.0"])
        h = by_hand(h, blk.mlp(blk.norm2(h)), keep[f"{i}.1"])
    expected = vit.forward_head(vit.norm(h))
    F.cross_entropy(expected, labels).backward()
    with torch.no_grad():
        plain = vit(images)
    torch.testing.assert_close(out, plain, rtol=1e-12, atol=1e-12)
    for name, p in vit.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert got["blocks.0.mlp.fc1.weight"].abs().sum() > 0


def test_resnet_odd_step_is_the_plain_train_mode_forward_and_a_block_kept_everywhere_gets_zero_grad():
    torch.manual_seed(0)
    net = ResNet18Cifar(channels=(4, 8, 8, 8), num_classes=3, zero_init_branches=False)
    cb = ResidualDroppath(drop_rate=0.5, seed=3)
    cb.setup(fake_trainer(0), net, "fit")
    images, labels = torch.randn(5, 3, 8, 8), torch.randint(0, 3, (5,))
    start_step(cb, net, 0)
    net(images)
    end_step(cb, net, 0)
    cb.masks[0]["0.0"] = torch.ones(5, dtype=torch.bool)  # block 0 kept for every sample
    start_step(cb, net, 1)
    out = net(images)
    F.cross_entropy(out, labels).backward()
    end_step(cb, net, 1)
    blk0 = residual_blocks(net)[0]
    assert blk0.conv1.weight.grad.abs().max() == 0 and blk0.bn2.weight.grad.abs().max() == 0
    assert net.conv1.weight.grad.abs().max() > 0  # the stem still learns through the shortcut
    with torch.no_grad():
        plain = net(images)  # train mode, batch statistics, no hooks
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)


# --- inside a Trainer -----------------------------------------------------------------------
class Recorder(SpiralClassifier):
    """Records, for every training batch, the step, phase and masks in use; checks validation."""

    def __init__(self, network: ResidualMLP, **kwargs) -> None:
        super().__init__(network, **kwargs)
        self.seen: list[tuple[int, str, dict]] = []
        self.val_checked = 0

    def _callback(self) -> ResidualDroppath:
        return next(cb for cb in self.trainer.callbacks if isinstance(cb, ResidualDroppath))

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        cb = self._callback()
        self.seen.append((self.trainer.global_step, cb.phase, {k: v.clone() for k, v in cb.current_masks.items()}))
        return loss

    def validation_step(self, batch, batch_idx):
        assert all(blk.branch_hook is None for blk in residual_blocks(self))
        assert self._callback().phase is None
        points = batch[0]
        with torch.no_grad():
            logits = self(points)
        p = params64(self.network)
        expected = hand_masked_forward(p, points, [torch.ones(len(points), dtype=torch.bool)] * len(self.network.layers))
        torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-6)
        self.val_checked += 1
        return super().validation_step(batch, batch_idx)


def tiny_trainer(tmp_path, callbacks, devices=1, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                     callbacks=callbacks, **kwargs)


def tiny_data() -> Spiral:
    return Spiral(num_points=64, val_points=8, batch_size=8, grid_size=4)


def test_gradient_accumulation_shares_the_parity_and_reuses_masks_per_micro_batch(tmp_path):
    L.seed_everything(0, verbose=False)
    model = Recorder(ResidualMLP(depth=2, width=WIDTH))
    trainer = tiny_trainer(tmp_path, [ResidualDroppath(drop_rate=0.5, seed=1)], max_steps=2,
                           accumulate_grad_batches=2, limit_val_batches=0)
    trainer.fit(model, datamodule=tiny_data())
    assert [(step, phase) for step, phase, _ in model.seen] == [(0, "drop"), (0, "drop"), (1, "reuse"), (1, "reuse")]
    for micro in (0, 1):
        drawn, reused = model.seen[micro][2], model.seen[2 + micro][2]
        assert all(torch.equal(drawn[k], reused[k]) for k in drawn)
    assert not torch.equal(model.seen[0][2]["0.0"], model.seen[1][2]["0.0"])
    assert all(blk.branch_hook is None for blk in residual_blocks(model))


def test_parity_and_masks_survive_checkpoint_and_resume(tmp_path):
    L.seed_everything(0, verbose=False)
    first = Recorder(ResidualMLP(depth=2, width=WIDTH))
    cb = ResidualDroppath(drop_rate=0.5, seed=1)
    trainer = tiny_trainer(tmp_path, [cb], max_steps=3, limit_val_batches=0)
    trainer.fit(first, datamodule=tiny_data())
    assert [phase for _, phase, _ in first.seen] == ["drop", "reuse", "drop"]
    ckpt = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["callbacks"]["ResidualDroppath"]
    assert saved["masks_step"] == 2
    assert all(torch.equal(saved["masks"][0][k], first.seen[2][2][k].cpu()) for k in layer_keys())

    resumed_cb = ResidualDroppath(drop_rate=0.5, seed=1)
    second = Recorder(ResidualMLP(depth=2, width=WIDTH))
    trainer = tiny_trainer(tmp_path, [resumed_cb], max_steps=5, limit_val_batches=0)
    trainer.fit(second, datamodule=tiny_data(), ckpt_path=ckpt)
    assert [(step, phase) for step, phase, _ in second.seen] == [(3, "reuse"), (4, "drop")]
    assert all(torch.equal(second.seen[0][2][k], first.seen[2][2][k]) for k in layer_keys())


def test_validation_runs_the_plain_network_and_fit_leaves_no_hooks(tmp_path):
    L.seed_everything(0, verbose=False)
    model = Recorder(ResidualMLP(depth=2, width=WIDTH))
    trainer = tiny_trainer(tmp_path, [ResidualDroppath(drop_rate=0.5, seed=1)], max_steps=3, val_check_interval=1,
                           limit_val_batches=1, num_sanity_val_steps=1)
    trainer.fit(model, datamodule=tiny_data())
    assert model.val_checked == 4  # sanity check + after each of the 3 steps
    assert all(blk.branch_hook is None for blk in residual_blocks(model))


class RankRecorder(SpiralClassifier):
    """Writes, per rank, the masks in use at every step (to compare ranks after a spawned fit)."""

    def __init__(self, out_dir: str, network: ResidualMLP, **kwargs) -> None:
        super().__init__(network, **kwargs)
        self.out_dir = out_dir

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        cb = next(c for c in self.trainer.callbacks if isinstance(c, ResidualDroppath))
        torch.save({k: v.clone() for k, v in cb.current_masks.items()},
                   f"{self.out_dir}/rank{self.trainer.global_rank}_step{self.trainer.global_step}.pt")
        return loss


class EndProcessGroup(L.Callback):
    """Destroys a spawned rank's process group once the fit is torn down, as the shortcutlab command
    does before it exits (commands.lightning_cli.end_process_group): left to the interpreter's exit,
    gloo's threads now and then abort the finished rank (SIGABRT)."""

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from commands.lightning_cli import end_process_group

        end_process_group()


@pytest.mark.slow
def test_ddp_does_not_wait_for_blocks_without_gradient_and_ranks_draw_their_own_masks(tmp_path):
    """One sample per rank: at a reuse step a block kept for that sample gets only a zero gradient
    on that rank (find_unused_parameters stays off, Lightning's default) while the other rank
    may have dropped it. The fit must finish, with masks drawn per rank."""
    L.seed_everything(0, verbose=False)
    model = RankRecorder(str(tmp_path), ResidualMLP(depth=3, width=WIDTH))
    trainer = tiny_trainer(tmp_path, [ResidualDroppath(drop_rate=0.5, seed=1), EndProcessGroup()], max_steps=4,
                           limit_val_batches=0, strategy="ddp_spawn", devices=2)
    trainer.fit(model, datamodule=Spiral(num_points=64, val_points=8, batch_size=1, grid_size=4))
    masks = {(r, s): torch.load(tmp_path / f"rank{r}_step{s}.pt") for r in (0, 1) for s in range(4)}
    keys = sorted(masks[0, 0])
    for rank in (0, 1):
        for step in (1, 3):
            assert all(torch.equal(masks[rank, step][k], masks[rank, step - 1][k]) for k in keys)
    # the case that would hang without the zero gradient: kept on one rank, dropped on the other
    assert any(bool(masks[0, s][k][0]) != bool(masks[1, s][k][0]) for s in (1, 3) for k in keys)
