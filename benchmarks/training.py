"""Training-loop figures on the quickstart (configs/digits_mae.yaml): Lightning against a plain
PyTorch loop, the evaluation callbacks' share of training, ResidualDroppath and data loading.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch
import yaml
from lightning.pytorch import Trainer, seed_everything

from callbacks.effective_rank import EffectiveRank
from callbacks.knn import KNNEvaluator
from callbacks.online_probe import OnlineLinearProbe
from callbacks.residual_droppath import ResidualDroppath
from callbacks.run_summary import RunSummary
from datamodules.digits import Digits
from lightning_mods.classifier import ImageClassifier
from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.optim import param_groups_weight_decay, scaled_lr, warmup_cosine_scheduler
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.vit import DecayedVisionTransformer

from .settings import Settings
from .timing import Row, ratio_row, skipped

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "digits_mae.yaml"
SHIPPED_EVAL_EVERY = 25  # check_val_every_n_epoch and the kNN / rank cadence of the quickstart
SHIPPED_EPOCHS = 100


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Lightning's info logs and warnings (e.g. few steps per epoch) off while timing."""
    import logging

    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def quickstart_model(settings: Settings) -> MaskedAutoencoder:
    """The quickstart's MAE (``model.init_args`` of configs/digits_mae.yaml); tiny in quick mode."""
    args = dict(yaml.safe_load(QUICKSTART.read_text())["model"]["init_args"])
    args["shortcut"] = ShortcutSchedule(**args["shortcut"]["init_args"])
    if settings.quick:
        args.update(embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2)
    return MaskedAutoencoder(image_size=16, in_chans=1, **args)


def quickstart_data(settings: Settings) -> Digits:
    return Digits(batch_size=settings.pick(128, 32), image_size=16)


def trainer(settings: Settings, root: str, callbacks: list, epochs: int, val_every: int | None,
            **kwargs) -> Trainer:
    return Trainer(accelerator=settings.torch_device.type, devices=1, precision=settings.precision,
                   max_epochs=epochs, callbacks=callbacks, default_root_dir=root,
                   check_val_every_n_epoch=val_every or 10 ** 6, limit_val_batches=1.0 if val_every else 0,
                   num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False, limit_train_batches=settings.max_batches, **kwargs)


def timed_fit(make: Callable[[], tuple[Trainer, object, object]]) -> float:
    """Seconds of ``trainer.fit`` alone (the Trainer and the model are built before the clock)."""
    tr, model, data = make()
    seed_everything(0, verbose=False)
    start = time.perf_counter()
    tr.fit(model, datamodule=data)
    return time.perf_counter() - start


# --- Lightning against a plain loop -----------------------------------------------------------
def plain_loop(model: MaskedAutoencoder, data: Digits, epochs: int, device: torch.device, settings: Settings) -> None:
    """What the quickstart's ``fit`` does per step, by hand: the same AdamW groups, LR schedule,
    batches and loss, nothing else."""
    data.setup("fit")
    loader = data.train_dataloader()
    hp = model.hparams
    groups = param_groups_weight_decay(model, hp.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=scaled_lr(hp.base_lr, data.batch_size), betas=tuple(hp.betas))
    per_epoch = min(len(loader), settings.max_batches or len(loader))
    total = epochs * per_epoch
    warmup = min(round(hp.warmup_epochs * per_epoch), total - 1)
    scheduler = warmup_cosine_scheduler(optimizer, warmup, total, hp.min_lr_ratio)["scheduler"]
    model.to(device).train()
    for _ in range(epochs):
        for i, (images, _labels) in enumerate(loader):
            if i == settings.max_batches:
                break
            with settings.autocast():
                loss = model(images.to(device))[0]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()


def cli_fit_parts(settings: Settings, root: str, epochs: int):
    """Trainer, model and datamodule exactly as ``shortcutlab fit`` builds them from the
    quickstart config, with the evaluation callbacks, the logger and checkpointing off."""
    from commands.lightning_cli import DEFAULT_CALLBACKS, ShortcutLabCLI
    from lightning.pytorch import LightningDataModule, LightningModule

    # the reliability callbacks (resume, non-finite guard, pre-emption) stay: every fit pays for them
    reliability = [c for c in DEFAULT_CALLBACKS if c["class_path"].startswith("callbacks.")]
    args = ["--config", str(QUICKSTART), f"--trainer.max_epochs={epochs}", f"--trainer.callbacks={json.dumps(reliability)}",
            "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={root}",
            f"--trainer.accelerator={settings.torch_device.type}", f"--trainer.precision={settings.precision}",
            f"--trainer.check_val_every_n_epoch={10 ** 6}"]
    if settings.max_batches:
        args.append(f"--trainer.limit_train_batches={settings.max_batches}")
    if settings.quick:
        args += ["--model.init_args.embed_dim=16", "--model.init_args.depth=2", "--model.init_args.num_heads=2",
                 "--model.init_args.decoder_embed_dim=16", "--model.init_args.decoder_depth=1",
                 "--model.init_args.decoder_num_heads=2", "--data.init_args.batch_size=32"]
    cli = ShortcutLabCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         run=False, args=args, save_config_callback=None)
    return cli.trainer, cli.model, cli.datamodule


def lightning_overhead(settings: Settings) -> list[Row]:
    epochs = settings.pick(3, 1)
    ratios, lightning, plain = [], [], []
    with quiet(), tempfile.TemporaryDirectory() as root:
        seed_everything(0, verbose=False)
        _, template, _ = cli_fit_parts(settings, root, epochs)
        initial = copy.deepcopy(template.state_dict())
        for _ in range(max(2, settings.rounds // 2) if not settings.quick else 1):
            t_lightning = timed_fit(lambda: cli_fit_parts(settings, root, epochs))

            model, data = quickstart_model(settings), quickstart_data(settings)
            model.load_state_dict(initial)
            seed_everything(0, verbose=False)
            start = time.perf_counter()
            plain_loop(model, data, epochs, settings.torch_device, settings)
            t_plain = time.perf_counter() - start
            lightning.append(t_lightning)
            plain.append(t_plain)
            ratios.append(t_lightning / t_plain)
    return [ratio_row("Lightning overhead (quickstart, callbacks off)",
                      f"`shortcutlab fit` {epochs} epochs / plain PyTorch loop", ratios, "<= 1.03",
                      f"plain loop {statistics.median(plain):.1f} s")]


# --- evaluation callbacks -----------------------------------------------------------------------
EVALUATIONS = ("online probe", "kNN", "effective rank", "pictures", "run summary")


def quickstart_callbacks(without: str | None) -> tuple[list, int]:
    """The quickstart's evaluation callbacks, every epoch, minus ``without``; and the number of
    reconstructions (the pictures)."""
    made = {"online probe": lambda: OnlineLinearProbe(),
            "kNN": lambda: KNNEvaluator(k=20, every_n_epochs=1),
            "effective rank": lambda: EffectiveRank(every_n_epochs=1, per_block=True),
            "run summary": lambda: RunSummary()}
    callbacks = [make() for name, make in made.items() if name != without]
    return callbacks, 0 if without == "pictures" else 8


def callback_shares(settings: Settings) -> list[Row]:
    """Each evaluation's cost, measured by removing it from a run that evaluates every epoch.

    Share of a run at the SHIPPED cadence: the online probe runs on its own step cadence
    (every ``every_n_steps`` batches), so its share is the same; kNN, effective rank and the pictures run every 25 epochs (the validation
    cadence), so their per-evaluation cost counts once per 25 training epochs; the run summary
    once per 100-epoch run.
    """
    epochs = settings.pick(2, 1)
    variants = ["all", *EVALUATIONS, "training only"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    with quiet(), tempfile.TemporaryDirectory() as root:

        def make(variant: str):
            def build():
                if variant == "training only":
                    callbacks, pictures, val_every = [], 0, None
                else:
                    callbacks, pictures = quickstart_callbacks(None if variant == "all" else variant)
                    val_every = 1
                model = quickstart_model(settings)
                model.hparams.num_reconstructions = pictures
                return trainer(settings, os.path.join(root, variant), callbacks, epochs, val_every), model, \
                    quickstart_data(settings)
            return build

        for _ in range(max(2, settings.rounds // 2) if not settings.quick else 1):
            for variant in variants:
                times[variant].append(timed_fit(make(variant)))
    rows = []
    train_only = statistics.median(times["training only"])
    shipped_total = []
    for name in EVALUATIONS:
        # per round: cost of this evaluation = (run with everything) - (run without it)
        costs = [a - b for a, b in zip(times["all"], times[name])]
        every_epoch = [c / t for c, t in zip(costs, times["training only"])]
        if name == "online probe":
            shipped = every_epoch
            cadence = f"every {OnlineLinearProbe().every_n_steps} steps"
        elif name == "run summary":
            shipped = [c / (t * SHIPPED_EPOCHS / epochs) for c, t in zip(costs, times["training only"])]
            cadence = f"once per {SHIPPED_EPOCHS}-epoch run"
        else:
            shipped = [c / (t * SHIPPED_EVAL_EVERY) for c, t in zip(costs, times["training only"])]
            cadence = f"every {SHIPPED_EVAL_EVERY} epochs"
        shipped_total.append(shipped)
        goal = "<= 0.03" if name == "online probe" else None
        rows.append(ratio_row("evaluation callbacks' share of a quickstart run", f"{name} at the shipped cadence",
                              shipped, goal, f"{cadence}; every epoch: {100 * statistics.median(every_epoch):.1f} %",
                              unit="share"))
    together = [sum(parts) for parts in zip(*shipped_total)]
    everything_every_epoch = [(a - t) / t for a, t in zip(times["all"], times["training only"])]
    rows.append(ratio_row("evaluation callbacks' share of a quickstart run", "all five together at the shipped cadences",
                          together, "<= 0.05",
                          f"all of them + validation every epoch: +{100 * statistics.median(everything_every_epoch):.0f} %"
                          f" of {train_only / epochs:.1f} s/epoch", unit="share"))
    return rows


# --- ResidualDroppath ---------------------------------------------------------------------------
def droppath_step(settings: Settings) -> list[Row]:
    steps = settings.pick(12, 2)
    cfg = settings.pick(dict(embed_dim=96, depth=12, num_heads=3), dict(embed_dim=16, depth=2, num_heads=2))
    ratios = []
    with quiet(), tempfile.TemporaryDirectory() as root:
        def make(callbacks: list):
            def build():
                torch.manual_seed(0)
                backbone = DecayedVisionTransformer(shortcut=ShortcutSchedule("linear", 0.6), img_size=16,
                                                    patch_size=4, in_chans=1, num_classes=10, **cfg)
                model = ImageClassifier(backbone, num_classes=10, in_chans=1, optimizer="adamw", base_lr=1e-3,
                                        warmup_epochs=0)
                return trainer(settings, root, callbacks, 1, None, max_steps=steps, logger=False), model, \
                    quickstart_data(settings)
            return build

        for _ in range(settings.pick(max(3, settings.rounds // 2), 1)):
            plain = timed_fit(make([]))
            dropped = timed_fit(make([ResidualDroppath(drop_rate=0.1, seed=0)]))
            ratios.append(dropped / plain)
    return [ratio_row("ResidualDroppath", f"ViT D{cfg['embed_dim']} depth {cfg['depth']} on digits, {steps} steps: "
                      "with / without the callback", ratios, "<= 1.05")]


# --- data loading ------------------------------------------------------------------------------
def data_loading(settings: Settings) -> list[Row]:
    """One epoch of the quickstart's train loader: 2 persistent workers against the main process."""
    if settings.quick:
        return [skipped("data loading", "digits train epoch: 2 persistent workers / in-process", "quick mode")]
    loaders = {}
    for workers in (0, 2):
        data = Digits(batch_size=128, image_size=16, num_workers=workers, persistent_workers=workers > 0)
        data.setup("fit")
        loaders[workers] = data.train_dataloader()
    times: dict[int, list[float]] = {0: [], 2: []}
    for workers, loader in loaders.items():
        for _ in loader:  # warm-up epoch (starts the persistent workers)
            pass
    for _ in range(settings.rounds):
        for workers, loader in loaders.items():
            start = time.perf_counter()
            for _ in loader:
                pass
            times[workers].append(time.perf_counter() - start)
    return [ratio_row("data loading", "digits train epoch: 2 persistent workers / in-process",
                      [a / b for a, b in zip(times[2], times[0])],
                      detail=f"in-process {1e3 * statistics.median(times[0]):.0f} ms/epoch")]


def run(settings: Settings) -> list[Row]:
    rows: list[Row] = []
    for item in (lightning_overhead, callback_shares, droppath_step, data_loading):
        rows += item(settings)
    return rows
