"""Network-level figures: shortcutlab's networks against stock timm and the reference
implementations of the papers (forward + backward, and full MAE steps), achieved FLOP/s,
activation memory, Python overhead of the residual sum, AdamW variants, channels_last and
``nn.Module.compile``.
"""
from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F
from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.backbone.resnet import ResNet18Cifar, ResNet50, cifar_stem_
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.uvit import UViT
from lightning_mods.backbone.vit import DecayedVisionTransformer

from .references import PlainUViT, ReferenceMAE
from .settings import Settings, train_step
from .timing import Row, interleaved, interleaved_fresh, paired_ratios, ratio_row, skipped
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT

DECAY = ShortcutSchedule("linear", 0.6)
NONE = ShortcutSchedule("none")


def classification_loss(x: torch.Tensor, labels: torch.Tensor):
    return lambda model: F.cross_entropy(model(x), labels)


def _compare(section: str, settings: Settings, reference: nn.Module, candidates: dict[str, nn.Module],
             loss_fn, goals: dict[str, str], label: str, calls: int = 2, optimizer: bool = False,
             fresh_copies: bool = False) -> list[Row]:
    """Time every candidate against ``reference`` interleaved; one row per candidate. With
    ``fresh_copies`` every round times new copies of the models, one step each
    (:func:`~benchmarks.timing.interleaved_fresh`), over at least twice the rounds."""
    models = {"reference": reference, **candidates}

    def steps() -> dict:
        made = {}
        for name, model in models.items():
            model = copy.deepcopy(model) if fresh_copies else model
            model.to(settings.torch_device).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if optimizer else None
            made[name] = train_step(model, loss_fn, settings, opt)
        return made

    if fresh_copies:
        # about a minute per pair of rows: 9 rounds of the ViTs' 1 s steps, up to 41 of a ResNet's 0.3 s
        times = interleaved_fresh(steps, settings.pick(2 * settings.rounds - 1, 1), device=settings.device,
                                  budget_s=settings.pick(60.0, 0.0), max_rounds=settings.pick(8 * settings.rounds + 1, 1))
    else:
        times = interleaved(steps(), settings.rounds, calls=settings.calls(calls), device=settings.device)
    ref_ms = 1e3 * sorted(times["reference"])[len(times["reference"]) // 2]
    return [ratio_row(section, f"{label}: {name}", paired_ratios(times, name, "reference"), goals.get(name),
                      f"reference {ref_ms:.0f} ms/step" + (f", new copies in each of {len(times['reference'])} rounds"
                                                           if fresh_copies else ""))
            for name in candidates]


def _same_weights(source: nn.Module, *targets: nn.Module) -> None:
    for target in targets:
        target.load_state_dict(source.state_dict(), strict=False)


def _decayed_vs_timm(settings: Settings, label: str, stock: nn.Module, none: nn.Module, decay: nn.Module,
                     batch: int, size: int) -> list[Row]:
    """One backbone row pair: ``none`` and alpha-0.6 decay against the stock timm network, same weights."""
    _same_weights(stock, none, decay)
    x = torch.randn(batch, 3, size, size, device=settings.device)
    y = torch.randint(0, 10, (batch,), device=settings.device)
    return _compare("backbones vs timm (fwd+bwd)", settings, stock,
                    {"decayed none / timm": none, "decayed alpha 0.6 / timm": decay},
                    classification_loss(x, y), {"decayed none / timm": "<= 1.00",
                                                "decayed alpha 0.6 / timm": "<= 1.02"}, label, fresh_copies=True)


def vit_vs_timm(settings: Settings) -> list[Row]:
    configs = settings.pick(
        [("ViT-Tiny/4 32px b64", dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3), 64),
         ("ViT-S/16 224px b8", dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6), 8)],
        [("ViT 16px tiny", dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2), 4)])
    rows = []
    for label, cfg, batch in configs:
        torch.manual_seed(0)
        stock = VisionTransformer(num_classes=10, **cfg)
        none = DecayedVisionTransformer(shortcut=NONE, zero_init_branches=False, num_classes=10, **cfg)
        decay = DecayedVisionTransformer(shortcut=DECAY, zero_init_branches=False, num_classes=10, **cfg)
        rows += _decayed_vs_timm(settings, label, stock, none, decay, batch, cfg["img_size"])
    return rows


def _timm_resnet18_cifar() -> ResNet:
    return cifar_stem_(ResNet(BasicBlock, [2, 2, 2, 2], num_classes=10), 3)


def resnet_vs_timm(settings: Settings) -> list[Row]:
    configs = settings.pick(
        [("ResNet18Cifar 32px b32", ResNet18Cifar, _timm_resnet18_cifar, 32, 32),
         ("ResNet-50 224px b4", ResNet50, lambda: ResNet(Bottleneck, [3, 4, 6, 3], num_classes=10), 224, 4)],
        [("ResNet18Cifar 8px b2", ResNet18Cifar, _timm_resnet18_cifar, 8, 2)])
    rows = []
    for label, ours, theirs, size, batch in configs:
        torch.manual_seed(0)
        stock = theirs()
        none = ours(shortcut=NONE, zero_init_branches=False, num_classes=10)
        decay = ours(shortcut=DECAY, zero_init_branches=False, num_classes=10)
        rows += _decayed_vs_timm(settings, label, stock, none, decay, batch, size)
    return rows


def channels_last_resnet(settings: Settings) -> list[Row]:
    """channels_last against the default layout for ResNet-50 (a GPU optimisation)."""
    if not settings.on_cuda:
        return [skipped("channels_last on CUDA (fwd+bwd)", "ResNet-50 channels_last / contiguous",
                        "CPU run (channels_last is a tensor-core layout; pass --device cuda)")]
    torch.manual_seed(0)
    batch = settings.pick(32, 2)
    x = torch.randn(batch, 3, 224, 224, device=settings.device)
    y = torch.randint(0, 10, (batch,), device=settings.device)
    plain = ResNet50(shortcut=DECAY, num_classes=10)
    last = copy.deepcopy(plain).to(memory_format=torch.channels_last)
    xl = x.contiguous(memory_format=torch.channels_last)
    steps = {"contiguous": train_step(plain.to(settings.device), classification_loss(x, y), settings),
             "channels_last": train_step(last.to(settings.device), classification_loss(xl, y), settings)}
    times = interleaved(steps, settings.rounds, calls=settings.calls(2), device=settings.device)
    return [ratio_row("channels_last on CUDA (fwd+bwd)", f"ResNet-50 224px b{batch}: channels_last / contiguous",
                      paired_ratios(times, "channels_last", "contiguous"))]


UVIT_FULL = dict(img_size=32, patch_size=4, in_chans=3, embed_dim=256, depth=12, num_heads=4)
UVIT_QUICK = dict(img_size=8, patch_size=4, in_chans=3, embed_dim=32, depth=2, num_heads=2)


def uvit_vs_plain(settings: Settings) -> list[Row]:
    cfg = settings.pick(UVIT_FULL, UVIT_QUICK)
    batch = settings.pick(16, 2)
    torch.manual_seed(0)
    plain = PlainUViT(**cfg)
    none = UViT(shortcut=NONE, **cfg)
    decay = UViT(shortcut=DECAY, **cfg)
    x = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"], device=settings.device)
    t = torch.randint(0, 1000, (batch,), device=settings.device)
    noise = torch.randn_like(x)
    label = f"U-ViT {cfg['img_size']}px/{cfg['patch_size']} D{cfg['embed_dim']} depth {cfg['depth'] + 1} b{batch}"
    return _compare("U-ViT vs plain U-ViT from timm Blocks (fwd+bwd)", settings, plain,
                    {"decayed none / plain": none, "decayed alpha 0.6 / plain": decay},
                    lambda model: F.mse_loss(model(x, t), noise),
                    {"decayed none / plain": "<= 1.02", "decayed alpha 0.6 / plain": "<= 1.02"}, label)


MAE_FULL = dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, decoder_embed_dim=256,
                decoder_depth=4, decoder_num_heads=8)
MAE_QUICK = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=32,
                 decoder_depth=1, decoder_num_heads=2)


def _mae_models(settings: Settings) -> tuple[dict, int, dict[str, nn.Module]]:
    cfg = settings.pick(MAE_FULL, MAE_QUICK)
    torch.manual_seed(0)
    ref = ReferenceMAE(img_size=cfg["img_size"], patch_size=cfg["patch_size"], embed_dim=cfg["embed_dim"],
                       depth=cfg["depth"], num_heads=cfg["num_heads"], decoder_embed_dim=cfg["decoder_embed_dim"],
                       decoder_depth=cfg["decoder_depth"], decoder_num_heads=cfg["decoder_num_heads"])
    ours = {f"unet_skips={skips}": MaskedAutoencoder(MaskedAutoencoderViT(shortcut=DECAY, unet_skips=skips, **cfg), num_reconstructions=0)
            for skips in (True, False)}
    return cfg, settings.pick(8, 2), {"reference": ref, **ours}


def _mae_loss(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    out = model(images)
    return out[0] if isinstance(out, tuple) else out  # MaskedAutoencoder returns (loss, pred, mask)


def step_flops(model: nn.Module, loss_fn) -> int:
    """FLOPs of one forward + backward (torch's FlopCounterMode; matmuls, convolutions, attention)."""
    counter = FlopCounterMode(display=False)
    with counter:
        loss_fn(model).backward()
    for p in model.parameters():
        p.grad = None
    return counter.get_total_flops()


def mae_vs_reference(settings: Settings) -> list[Row]:
    cfg, batch, models = _mae_models(settings)
    images = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"], device=settings.device)
    loss_fn = lambda model: _mae_loss(model, images)  # noqa: E731
    for model in models.values():
        model.to(settings.device)
    flops = {name: step_flops(model, loss_fn) for name, model in models.items()}
    label = (f"MAE ViT D{cfg['embed_dim']}/{cfg['patch_size']} {cfg['img_size']}px b{batch} (decoder "
             f"{cfg['decoder_embed_dim']}-d x "
             f"{cfg['decoder_depth']}) step incl. AdamW")
    rows = _compare("MAE train step vs He et al.'s MAE (timm Blocks)", settings, models["reference"],
                    {k: v for k, v in models.items() if k != "reference"}, loss_fn,
                    {"unet_skips=False": "<= 1.02"}, label, optimizer=True)
    for row in rows:
        name = row.name.rsplit(": ", 1)[1]
        row.detail += f"; FLOPs {flops[name] / flops['reference']:.3f}x the reference's"
    return rows


def matmul_rate(settings: Settings) -> tuple[callable, float]:
    """A square matmul in the run's precision and its FLOPs (the machine's practical peak)."""
    n = settings.pick(1024, 256)
    dtype = torch.bfloat16 if settings.precision == "bf16-mixed" else torch.float32
    a = torch.randn(n, n, device=settings.device, dtype=dtype)
    b = torch.randn(n, n, device=settings.device, dtype=dtype)
    return (lambda: a @ b), 2.0 * n ** 3


def achieved_flops(settings: Settings) -> list[Row]:
    """Achieved FLOP/s of the MAE and classifier training steps over the matmul rate (MFU)."""
    cfg, batch, models = _mae_models(settings)
    mae = models["unet_skips=True"].to(settings.device)
    images = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"], device=settings.device)
    vit_cfg = settings.pick(dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3),
                            dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2))
    vit_batch = settings.pick(64, 4)
    vit = DecayedVisionTransformer(shortcut=DECAY, num_classes=10, **vit_cfg).to(settings.device)
    x = torch.randn(vit_batch, 3, vit_cfg["img_size"], vit_cfg["img_size"], device=settings.device)
    y = torch.randint(0, 10, (vit_batch,), device=settings.device)
    jobs = {f"MAE ViT D{cfg['embed_dim']}/{cfg['patch_size']} {cfg['img_size']}px b{batch} step": (mae, lambda m: _mae_loss(m, images)),
            f"decayed ViT D{vit_cfg['embed_dim']}/4 {vit_cfg['img_size']}px classifier step b{vit_batch}": (vit, classification_loss(x, y))}
    mm, mm_flops = matmul_rate(settings)
    variants = {"matmul": mm}
    flops = {}
    for name, (model, loss_fn) in jobs.items():
        model.train()
        flops[name] = step_flops(model, loss_fn)
        variants[name] = train_step(model, loss_fn, settings, torch.optim.AdamW(model.parameters(), lr=1e-4))
    times = interleaved(variants, settings.rounds, calls=settings.calls(2), device=settings.device)
    rows = []
    for name in jobs:
        mfu = [(flops[name] / t) / (mm_flops / m) for t, m in zip(times[name], times["matmul"])]
        peak = mm_flops / sorted(times["matmul"])[len(times["matmul"]) // 2] / 1e9
        rows.append(ratio_row("achieved FLOP/s / matmul rate", name, mfu, ">= 0.60",
                              f"{flops[name] / 1e9:.1f} GFLOP/step (fwd+bwd); matmul {peak:.0f} GFLOP/s", unit=""))
    return rows


def saved_tensor_bytes(model: nn.Module, loss_fn) -> int:
    """Bytes of the distinct tensors autograd saves for backward in one forward (the activation
    memory a step holds at its peak, a CPU-measurable proxy of peak memory)."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[(storage.data_ptr(), t.device.type)] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model)
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return sum(seen.values())


def cuda_peak_bytes(model: nn.Module, loss_fn, settings: Settings) -> int:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, loss_fn, settings, opt)()  # optimiser state exists from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(model, loss_fn, settings, opt)()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def mae_memory(settings: Settings) -> list[Row]:
    cfg, batch, models = _mae_models(settings)
    images = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"], device=settings.device)
    loss_fn = lambda model: _mae_loss(model, images)  # noqa: E731
    rows = []
    for name, model in models.items():
        model.to(settings.device).train()
    with settings.autocast():
        saved = {name: saved_tensor_bytes(model, loss_fn) for name, model in models.items()}
    for name in ("unet_skips=True", "unet_skips=False"):
        ratio = saved[name] / saved["reference"]
        rows.append(ratio_row("peak memory, MAE step vs He et al.'s MAE", f"saved activations: {name} / reference",
                              [ratio], "<= 1.05", f"reference {saved['reference'] / 2**20:.1f} MiB "
                              "(bytes autograd saves for backward, saved_tensors_hooks)"))
    if settings.on_cuda:
        peak = {name: cuda_peak_bytes(model, loss_fn, settings) for name, model in models.items()}
        for name in ("unet_skips=True", "unet_skips=False"):
            rows.append(ratio_row("peak memory, MAE step vs He et al.'s MAE",
                                  f"torch.cuda.max_memory_allocated: {name} / reference",
                                  [peak[name] / peak["reference"]], "<= 1.05",
                                  f"reference {peak['reference'] / 2**20:.0f} MiB (weights, AdamW state, activations)"))
    return rows


def residual_python_overhead(settings: Settings) -> list[Row]:
    """A ViT so small that Python dominates: the cost of the residual sum and an installed
    ``branch_hook`` (what ResidualDroppath adds) per sub-layer."""
    cfg = dict(img_size=8, patch_size=4, embed_dim=16, depth=12, num_heads=1, num_classes=2)
    torch.manual_seed(0)
    stock = VisionTransformer(**cfg)
    decay = DecayedVisionTransformer(shortcut=DECAY, zero_init_branches=False, **cfg)
    hooked = copy.deepcopy(decay)
    for blk in hooked.blocks:
        blk.branch_hook = lambda block, j, branch: branch
    x = torch.randn(1, 3, 8, 8, device=settings.device)
    y = torch.zeros(1, dtype=torch.long, device=settings.device)
    steps = {name: train_step(m.to(settings.device), classification_loss(x, y), settings)
             for name, m in (("stock", stock), ("decay", decay), ("hooked", hooked))}
    times = interleaved(steps, settings.rounds, calls=settings.calls(20), device=settings.device)
    rows = []
    for name, label in (("decay", "decayed sum"), ("hooked", "decayed sum + branch_hook")):
        extra_us = [(a - b) / 24 * 1e6 for a, b in zip(times[name], times["stock"])]
        extra_us.sort()
        rows.append(ratio_row("Python work per step", f"tiny ViT (12 blocks, 5 tokens) {label} / timm",
                              paired_ratios(times, name, "stock"),
                              detail=f"{extra_us[len(extra_us) // 2]:+.1f} us per sub-layer (fwd+bwd)"))
    return rows


def adamw_variants(settings: Settings) -> list[Row]:
    """``torch.optim.AdamW`` step: for-loop vs ``foreach`` (the default) vs ``fused``."""
    cfg = settings.pick(dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
                        dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2))
    model = VisionTransformer(num_classes=10, **cfg).to(settings.device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    params = list(model.parameters())
    variants = {"foreach": torch.optim.AdamW(params, lr=1e-4, foreach=True),
                "for-loop": torch.optim.AdamW(params, lr=1e-4, foreach=False)}
    try:
        variants["fused"] = torch.optim.AdamW(params, lr=1e-4, fused=True)
    except (RuntimeError, ValueError):
        pass
    times = interleaved({name: opt.step for name, opt in variants.items()}, settings.rounds, calls=settings.calls(3),
                        device=settings.device)
    n = sum(p.numel() for p in params) / 1e6
    rows = [ratio_row("AdamW step", f"ViT-S ({n:.1f} M params): for-loop / foreach",
                      paired_ratios(times, "for-loop", "foreach"),
                      detail=f"foreach {1e3 * min(times['foreach']):.1f} ms")]
    if "fused" in times:
        rows.append(ratio_row("AdamW step", f"ViT-S ({n:.1f} M params): fused / foreach",
                              paired_ratios(times, "fused", "foreach")))
    return rows


def compiled_backbone(settings: Settings) -> list[Row]:
    """``nn.Module.compile()`` (in place: the state_dict keeps its keys, no ``_orig_mod.``)."""
    section = "torch.compile (opt-in)"
    if not settings.compile:
        return [skipped(section, "decayed ViT-Tiny/4 compiled / eager", "pass --compile (~50 s cold on 2 CPUs)")]
    cfg = settings.pick(dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3),
                        dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2))
    batch = settings.pick(64, 4)
    torch.manual_seed(0)
    eager = DecayedVisionTransformer(shortcut=DECAY, num_classes=10, **cfg).to(settings.device)
    compiled = copy.deepcopy(eager)
    keys = list(compiled.state_dict())
    start = time.perf_counter()
    compiled.compile()
    x = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"], device=settings.device)
    y = torch.randint(0, 10, (batch,), device=settings.device)
    compiled_step = train_step(compiled, classification_loss(x, y), settings)
    compiled_step()
    cold = time.perf_counter() - start
    if list(compiled.state_dict()) != keys:
        raise AssertionError("nn.Module.compile changed the state_dict keys")
    times = interleaved({"eager": train_step(eager, classification_loss(x, y), settings),
                         "compiled": compiled_step}, settings.rounds, calls=settings.calls(2), device=settings.device)
    return [ratio_row(section, f"decayed ViT-Tiny/4 b{batch} fwd+bwd: compiled / eager",
                      paired_ratios(times, "compiled", "eager"),
                      detail=f"cold compile {cold:.0f} s; state_dict keys unchanged")]


def run(settings: Settings) -> list[Row]:
    rows: list[Row] = []
    for item in (vit_vs_timm, resnet_vs_timm, channels_last_resnet, uvit_vs_plain, mae_vs_reference,
                 achieved_flops, mae_memory, residual_python_overhead, adamw_variants, compiled_backbone):
        rows += item(settings)
    return rows

