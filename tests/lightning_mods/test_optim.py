"""The optimiser recipe: global-batch lr scaling, warm-up + cosine, no decay on norms/biases/tokens."""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.recipe.optim import (global_batch_size, param_groups_weight_decay, per_device_batch_size, scaled_lr,
                                  warmup_cosine)
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
from helpers.diffusion_modules import diffusion_module


def fake_trainer(batch=32, world_size=4, accumulate=2, total_steps=1000, max_epochs=10):
    return SimpleNamespace(datamodule=SimpleNamespace(batch_size=batch), world_size=world_size,
                           accumulate_grad_batches=accumulate, estimated_stepping_batches=total_steps,
                           max_epochs=max_epochs)


def test_global_batch_counts_devices_nodes_and_accumulation():
    trainer = fake_trainer(batch=32, world_size=8, accumulate=4)  # world_size = devices x nodes
    assert per_device_batch_size(trainer) == 32
    assert global_batch_size(trainer) == 32 * 8 * 4
    assert scaled_lr(1.5e-4, 1024) == pytest.approx(6e-4)  # the paper's peak lr at batch 1024


def test_warmup_then_cosine_hand_computed():
    # U-ViT's customized_lr_scheduler: min(step / warmup, 1); MAE: lr * (iteration / epoch length) / warmup
    assert warmup_cosine(0, 10, 110) == 0.0
    assert warmup_cosine(1, 10, 110) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 110) == pytest.approx(0.9)
    assert warmup_cosine(10, 10, 110) == pytest.approx(1.0)
    assert warmup_cosine(60, 10, 110) == pytest.approx(0.5)
    assert warmup_cosine(35, 10, 110) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))
    assert warmup_cosine(110, 10, 110) == pytest.approx(0.0, abs=1e-12)
    assert warmup_cosine(110, 10, 110, min_lr_ratio=0.1) == pytest.approx(0.1)


def test_mae_peak_lr_and_no_decay_groups():
    model = MaskedAutoencoder(MaskedAutoencoderViT(img_size=16, in_chans=1, patch_size=4, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2), base_lr=1.5e-4, warmup_epochs=2)
    model.trainer = fake_trainer(batch=128, world_size=8, accumulate=1, total_steps=1000, max_epochs=10)
    config = model.configure_optimizers()
    opt = config["optimizer"]
    assert opt.defaults["lr"] == pytest.approx(1.5e-4 * 1024 / 256)
    assert opt.defaults["betas"] == (0.9, 0.95)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[i] for i in decayed}
    assert all(p.ndim >= 2 for n, p in model.named_parameters() if n in decayed_names)
    for n in names.values():
        if n.endswith(".bias") or "norm" in n:
            assert n not in decayed_names, n
    # as both MAE repositories (add_weight_decay), the 3-D cls and mask tokens are decayed
    assert {"network.encoder.cls_token", "network.decoder.cls_token"} <= decayed_names
    assert "network.encoder.blocks.0.attn.qkv.weight" in decayed_names
    sched = config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"
    # 2 of 10 epochs of 1000 steps are warm-up: 200 steps
    assert sched.lr_lambdas[0](200) == pytest.approx(1.0) and sched.lr_lambdas[0](100) == pytest.approx(0.5)
    assert sched.lr_lambdas[0](199) == pytest.approx(199 / 200)


def test_lightning_runs_the_first_steps_at_0_then_1_over_warmup_of_the_peak(tmp_path):
    """The learning rates the optimiser actually used, read before each step of a real fit."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mods.recipe.optim import warmup_cosine_scheduler

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.8)
            return {"optimizer": opt, "lr_scheduler": warmup_cosine_scheduler(opt, 4, 8)}

    seen = []

    class Record(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(optimizer.param_groups[0]["lr"])

    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
                        default_root_dir=tmp_path)
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(12, 2)), batch_size=2))
    # by hand: 0.8 * (0/4, 1/4, 2/4, 3/4), then the cosine from the peak over 4 steps
    assert seen == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 0.8 * 0.5 * (1 + math.cos(math.pi / 4))])


def test_param_groups_skip_frozen_parameters():
    layer = torch.nn.Linear(3, 3)
    layer.bias.requires_grad_(False)
    groups = param_groups_weight_decay(layer, 0.05)
    assert [len(g["params"]) for g in groups] == [1]


class _GroupedParts(torch.nn.Module):
    """One parameter of every kind the weight-decay rule tells apart."""

    def __init__(self) -> None:
        super().__init__()
        self.pos_embed = torch.nn.Parameter(torch.zeros(1, 4, 3))  # a name part: no decay
        self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, 3))  # a name part: no decay
        self.label_emb = torch.nn.Embedding(5, 3)  # 2-D, but the name starts with a part: no decay
        self.gate_alpha = torch.nn.Parameter(torch.ones(2, 2))  # 2-D, the leaf contains "alpha": no decay
        self.proj = torch.nn.Linear(3, 3)  # weight decayed, bias (1-D) not
        self.norm = torch.nn.LayerNorm(3)  # 1-D: no decay
        self.frozen = torch.nn.Linear(3, 3, bias=False).requires_grad_(False)  # left out


def test_param_groups_match_the_rule_written_out_by_hand():
    model = _GroupedParts()
    p = dict(model.named_parameters())
    groups = param_groups_weight_decay(model, 0.05)
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    assert {id(x) for x in groups[0]["params"]} == {id(p["proj.weight"])}
    assert {id(x) for x in groups[1]["params"]} == {id(p[n]) for n in (
        "pos_embed", "cls_token", "label_emb.weight", "gate_alpha", "proj.bias", "norm.weight", "norm.bias")}
    # MAE's rule (no name parts): tokens and embeddings of 2+ dimensions are decayed
    groups = param_groups_weight_decay(model, 0.05, no_decay_name_parts=())
    assert {id(x) for x in groups[0]["params"]} == {id(p[n]) for n in (
        "pos_embed", "cls_token", "label_emb.weight", "gate_alpha", "proj.weight")}
    assert {id(x) for x in groups[1]["params"]} == {id(p[n]) for n in ("proj.bias", "norm.weight", "norm.bias")}


def family_modules():
    """One small module of each family, with its default AdamW recipe."""
    from lightning_mods.classifier import ImageClassifier
    from lightning_mods.backbone.resnet import ResNet18Cifar
    from lightning_mods.backbone.shortcut import ShortcutSchedule
    from test_diffusion import TINY

    torch.manual_seed(0)
    classifier = ImageClassifier(ResNet18Cifar(shortcut=ShortcutSchedule("linear", 0.6), channels=(8, 16, 16, 32)),
                                 num_classes=10, in_chans=3, optimizer="adamw", base_lr=1e-3, warmup_epochs=0)
    return {"mae": MaskedAutoencoder(MaskedAutoencoderViT(img_size=16, in_chans=1, patch_size=4, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2), warmup_epochs=0, base_lr=1e-2),  # updates large enough that a 0.1 % lr error shows
            "diffusion": diffusion_module(**TINY, warmup_steps=0), "classifier": classifier}


@pytest.mark.parametrize("family", ["mae", "diffusion", "classifier"])
def test_every_family_runs_fused_adamw_and_10_steps_equal_foreach(family, monkeypatch):
    """Issue 18, item 3: the fused kernel where torch has one (here the CPU), the same updates
    as ``foreach`` within 1e-6 over 10 steps of the family's own groups, lr and schedule."""
    import copy

    import lightning_mods.recipe.optim as optim

    fused_module = family_modules()[family]
    foreach_module = copy.deepcopy(fused_module)
    runs = []
    for module, fused in ((fused_module, True), (foreach_module, False)):
        if not fused:
            monkeypatch.setattr(optim, "fused_kernel_available", lambda params: False)
        module.trainer = fake_trainer(batch=64, world_size=1, accumulate=1, total_steps=10, max_epochs=1)
        config = module.configure_optimizers()
        optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
        assert isinstance(optimizer, torch.optim.AdamW)
        assert bool(optimizer.defaults["fused"]) is fused and optimizer.defaults["foreach"] is None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        draws = torch.Generator().manual_seed(1)
        for _ in range(10):
            for p in params:
                p.grad = torch.randn(p.shape, generator=draws)
            optimizer.step()
            scheduler.step()
        runs.append([p.detach().clone() for p in params])
    for got, want in zip(*runs):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert any(not torch.equal(p, q) for p, q in zip(runs[0], [p.detach() for p in family_modules()[family].parameters()
                                                                if p.requires_grad]))  # the steps moved the weights


def test_adamw_falls_back_where_torch_has_no_fused_kernel():
    from lightning_mods.recipe.optim import adamw

    integer = torch.zeros(3, dtype=torch.int64)
    assert adamw([torch.nn.Parameter(torch.zeros(3))], lr=1e-3).defaults["fused"] is True
    assert not optim_fused(adamw([torch.nn.Parameter(torch.zeros(3)), integer], lr=1e-3))
    assert adamw([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, foreach=True).defaults["foreach"] is True


def optim_fused(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.defaults["fused"])


def test_adamw_skips_the_capture_check_only_without_a_cuda_or_xpu_context(monkeypatch):
    """The capture check asks NVML whether CUDA is available under Lightning (no cache on a CUDA
    build without a GPU); it is skipped only while no context exists, and runs as torch's otherwise."""
    from lightning_mods.recipe.optim import adamw

    checks = []
    monkeypatch.setattr(torch.optim.AdamW, "_accelerator_graph_capture_health_check", lambda self: checks.append(1))
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = adamw([w], lr=0.1, weight_decay=0.0)
    reference = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, weight_decay=0.0)
    for opt in (optimizer, reference):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.tensor([1.0, -2.0, 0.5])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    if getattr(torch, "xpu", None) is not None:
        monkeypatch.setattr(torch.xpu, "is_initialized", lambda: False)
    optimizer.step()
    assert checks == []
    reference.step()  # torch's own class always checks
    assert checks == [1]
    torch.testing.assert_close(w.detach(), reference.param_groups[0]["params"][0].detach(), rtol=0, atol=1e-7)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    optimizer.step()
    assert checks == [1, 1]


def lars_reference(weights: list[np.ndarray], grads_per_step: list[list[np.ndarray]], lr: float, momentum: float,
                   trust: float) -> list[np.ndarray]:
    """MAE's LARS (facebookresearch/mae util/lars.py) in float64 numpy: for ndim > 1,
    ``g <- g * trust * |w| / |g|`` (1 where a norm is 0); then ``mu <- momentum * mu + g``,
    ``w <- w - lr * mu``."""
    weights = [w.astype(np.float64).copy() for w in weights]
    mus = [np.zeros_like(w) for w in weights]
    for grads in grads_per_step:
        for i, (w, g) in enumerate(zip(weights, grads)):
            g = g.astype(np.float64)
            if w.ndim > 1:
                w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
                g = g * (trust * w_norm / g_norm if w_norm > 0 and g_norm > 0 else 1.0)
            mus[i] = momentum * mus[i] + g
            weights[i] = w - lr * mus[i]
    return weights


def test_lars_step_equals_maes_lars_in_float64():
    from lightning_mods.recipe.optim import lars

    draws = np.random.default_rng(0)
    start = [draws.normal(size=(3, 4)), draws.normal(size=4), np.zeros((2, 2))]  # a zero weight: ratio 1
    steps = [[draws.normal(size=w.shape) * 10 ** k for w in start] for k in (0, -2, 1)]
    params = [torch.nn.Parameter(torch.tensor(w, dtype=torch.float64)) for w in start]
    optimizer = lars(params, lr=6.4, momentum=0.9, trust_coefficient=0.001)
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g, dtype=torch.float64)
        optimizer.step()
    for got, want in zip(params, lars_reference(start, steps, 6.4, 0.9, 0.001)):
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-13, atol=1e-15)
    assert not np.allclose(params[1].detach().numpy(), start[1])  # the bias moved by plain momentum steps
