"""Training-loop figures on the quickstart (configs/digits_mae.yaml): Lightning against a plain
PyTorch loop, the evaluation callbacks' share of training, ResidualDroppath and data loading.
"""
from __future__ import annotations

import inspect

import contextlib
import copy
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import yaml
from lightning.pytorch import Callback, Trainer, seed_everything

from callbacks.measurement.effective_rank import EffectiveRank
from callbacks._utils.feature_collection import collect_features
from callbacks.measurement.knn import KNNEvaluator
from callbacks.measurement.online_probe import DepthHeads, OnlineLinearProbe
from callbacks.training.residual_droppath import ResidualDroppath
from callbacks.reporting.run_summary import RunSummary
from datamodules.digits import Digits
from lightning_mods.classifier import ImageClassifier
from lightning_mods.evaluation._eval_mode import isolated_eval
from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.recipe.optim import adamw, param_groups_weight_decay, scaled_lr, warmup_cosine_scheduler
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.vit import DecayedVisionTransformer

from .hook_clock import END_HOOKS, TRAIN_HOOKS, VALIDATION_HOOKS, HookClock
from .settings import Settings
from .timing import Row, ratio_row, skipped, synchronize
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT

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


def quickstart_model(settings: Settings, **changes: object) -> MaskedAutoencoder:
    """The quickstart's MAE (``model.init_args`` of configs/digits_mae.yaml) with ``changes``;
    tiny in quick mode."""
    recipe = dict(yaml.safe_load(QUICKSTART.read_text())["model"]["init_args"])
    network = dict(recipe.pop("network")["init_args"])
    network["shortcut"] = ShortcutSchedule(**network["shortcut"]["init_args"])
    takes = inspect.signature(MaskedAutoencoderViT).parameters
    network.update({k: v for k, v in changes.items() if k in takes})
    recipe.update({k: v for k, v in changes.items() if k not in takes})
    if settings.quick:
        network.update(embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2)
    return MaskedAutoencoder(MaskedAutoencoderViT(img_size=16, in_chans=1, **network), **recipe)


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
def plain_steps(model: MaskedAutoencoder, data: Digits, epochs: int, device: torch.device,
                settings: Settings) -> Iterator[None]:
    """What the quickstart's ``fit`` does per step, by hand: the same AdamW (fused where the
    module's is), groups, LR schedule, batches and loss, nothing else. Yields once after the
    set-up (data, loader, optimiser), then after each optimiser step."""
    data.setup("fit")
    loader = data.train_dataloader()
    hp = model.hparams
    groups = param_groups_weight_decay(model, hp.weight_decay, no_decay_name_parts=())  # as MaskedAutoencoder
    model.to(device)  # before the optimiser: the fused kernel is chosen for the parameters' device
    optimizer = adamw(groups, lr=scaled_lr(hp.base_lr, data.batch_size), betas=tuple(hp.betas))
    per_epoch = min(len(loader), settings.max_batches or len(loader))
    total = epochs * per_epoch
    warmup = min(round(hp.warmup_epochs * per_epoch), total - 1)
    scheduler = warmup_cosine_scheduler(optimizer, warmup, total, hp.min_lr_ratio)["scheduler"]
    model.train()
    yield
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
            yield


class PlainStepAfterEach(Callback):
    """Runs the plain loop one step after each of the fit's training steps, keeping the seconds
    spent in it per fit epoch, and marks when each fit epoch starts and when training ends: the
    two loops share every stretch of the machine's speed, step by step. :meth:`set_up` runs the
    plain loop's set-up (before the fit), :meth:`finish` the rest of it (after)."""

    def __init__(self, steps: Iterator[None], device: torch.device) -> None:
        self.steps, self.device = steps, device
        self.setup_seconds = 0.0
        self.epoch_seconds: list[float] = []  # the plain steps' seconds in each fit epoch
        self.marks: list[float] = []  # each fit epoch's start, then the end of training

    def _timed_steps(self, count: Optional[int]) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        for done, _ in enumerate(self.steps, start=1):
            if done == count:
                break
        synchronize(self.device)
        return time.perf_counter() - start

    def set_up(self) -> None:
        self.setup_seconds = self._timed_steps(1)

    def finish(self) -> None:
        self.epoch_seconds[-1] += self._timed_steps(None)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: object) -> None:
        self.marks.append(time.perf_counter())
        self.epoch_seconds.append(0.0)

    def on_train_batch_end(self, trainer: Trainer, pl_module: object, outputs: object, batch: object,
                           batch_idx: int) -> None:
        self.epoch_seconds[-1] += self._timed_steps(1)

    def on_train_end(self, trainer: Trainer, pl_module: object) -> None:
        self.marks.append(time.perf_counter())

    def fit_epoch_seconds(self) -> list[float]:
        """The fit's own seconds per epoch: from the epoch's start to the next one's (the end of
        training for the last), less the plain steps taken in it."""
        return [b - a - plain for a, b, plain in zip(self.marks, self.marks[1:], self.epoch_seconds)]


def over_a_run(per_epoch: list[float], times: int) -> float:
    """Seconds per occurrence over a run of ``times`` occurrences, from the measured ones: the
    later ones are the steady cost, the first one's excess over them (allocations, heads and
    buffers built) is paid once and spread over the run. One measured occurrence is the steady cost."""
    steady = statistics.mean(per_epoch[1:] or per_epoch)
    return steady + max(per_epoch[0] - steady, 0.0) / times


RELIABILITY_CALLBACKS = ("callbacks.reliability.exact_resume.ExactResume", "callbacks.reliability.nonfinite_guard.NonFiniteGuard",
                         "callbacks.reliability.preemption.PreemptionCheckpoint")


def cli_fit_parts(settings: Settings, root: str, epochs: int):
    """Trainer, model and datamodule exactly as ``shortcutlab fit`` builds them from the
    quickstart config, with the evaluation callbacks, the logger and checkpointing off."""
    from commands.lightning_cli import DEFAULT_CALLBACKS, ShortcutLabCLI
    from lightning.pytorch import LightningDataModule, LightningModule

    # the reliability callbacks (resume, non-finite guard, pre-emption) stay: every fit pays for
    # them; the progress bar and the model summary are display, off as in the plain loop
    reliability = [c for c in DEFAULT_CALLBACKS if c["class_path"] in RELIABILITY_CALLBACKS]
    args = ["--config", str(QUICKSTART), f"--trainer.max_epochs={epochs}", f"--trainer.callbacks={json.dumps(reliability)}",
            "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={root}",
            f"--trainer.accelerator={settings.torch_device.type}", f"--trainer.precision={settings.precision}",
            f"--trainer.check_val_every_n_epoch={10 ** 6}"]
    if settings.max_batches:
        args.append(f"--trainer.limit_train_batches={settings.max_batches}")
    if settings.quick:
        args += ["--model.network.embed_dim=16", "--model.network.depth=2", "--model.network.num_heads=2",
                 "--model.network.decoder_embed_dim=16", "--model.network.decoder_depth=1",
                 "--model.network.decoder_num_heads=2", "--data.init_args.batch_size=32"]
    cli = ShortcutLabCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         run=False, args=args, save_config_callback=None)
    return cli.trainer, cli.model, cli.datamodule


def lightning_overhead(settings: Settings) -> list[Row]:
    """``shortcutlab fit`` (reliability callbacks on) against the plain loop, interleaved step by
    step in one process: after each of the fit's steps the plain loop takes its own step on its
    own copy of the model and data (:class:`PlainStepAfterEach`). Timing whole fits one after
    the other instead gave per-round ratios from 0.95 to 1.10 on this shared machine, whose
    speed changes within seconds.

    The goal is the quickstart's run, 100 epochs: each side's one-time set-up and tear-down
    (the fit's before its first epoch and after training, about 25 ms; the plain loop's data,
    loader and optimiser) counts once, its epochs as :func:`over_a_run` spreads them (the
    first epoch's excess once, the later ones' mean per epoch), as the shares below. The ratio
    of the short fits themselves, whose set-up weighs 33 times as much, is information."""
    epochs = settings.pick(3, 1)
    ratios, short_ratios, fit_setups, plain_setups, plains = [], [], [], [], []
    with quiet(), tempfile.TemporaryDirectory() as root:
        seed_everything(0, verbose=False)
        _, template, _ = cli_fit_parts(settings, root, epochs)
        initial = copy.deepcopy(template.state_dict())
        for _ in range(settings.pick(max(3, settings.rounds // 2), 1) + 1):  # the first round warms up
            trainer_, model, data = cli_fit_parts(settings, root, epochs)
            plain_model, plain_data = quickstart_model(settings), quickstart_data(settings)
            plain_model.load_state_dict(initial)
            plain = PlainStepAfterEach(plain_steps(plain_model, plain_data, epochs, settings.torch_device, settings),
                                       settings.torch_device)
            trainer_.callbacks.append(plain)
            plain.set_up()
            seed_everything(0, verbose=False)
            start = time.perf_counter()
            trainer_.fit(model, datamodule=data)
            wall = time.perf_counter() - start
            plain.finish()
            fit_epochs = plain.fit_epoch_seconds()
            fit_setup = wall - (plain.marks[-1] - plain.marks[0])
            fit_run = fit_setup + SHIPPED_EPOCHS * over_a_run(fit_epochs, SHIPPED_EPOCHS)
            plain_run = plain.setup_seconds + SHIPPED_EPOCHS * over_a_run(plain.epoch_seconds, SHIPPED_EPOCHS)
            ratios.append(fit_run / plain_run)
            short_ratios.append((fit_setup + sum(fit_epochs)) / (plain.setup_seconds + sum(plain.epoch_seconds)))
            fit_setups.append(fit_setup)
            plain_setups.append(plain.setup_seconds)
            plains.append(plain.setup_seconds + sum(plain.epoch_seconds))
    ratios, short_ratios = ratios[1:], short_ratios[1:]
    fit_setups, plain_setups, plains = fit_setups[1:], plain_setups[1:], plains[1:]
    section = "Lightning overhead (quickstart, reliability callbacks on)"
    setups = (f"set-up and tear-down {1e3 * statistics.median(fit_setups):.0f} ms (fit) and "
              f"{1e3 * statistics.median(plain_setups):.0f} ms (plain loop)")
    return [ratio_row(section, f"`shortcutlab fit` / plain PyTorch loop over a {SHIPPED_EPOCHS}-epoch quickstart run",
                      ratios, "<= 1.03",
                      f"{len(ratios)} fits of {epochs} epochs interleaved step by step; {setups} counted once per run",
                      raw={"short_fit_ratio": short_ratios}),
            ratio_row(section, f"`shortcutlab fit` {epochs} epochs / plain PyTorch loop, set-up included", short_ratios,
                      detail=f"the same fits; {setups}; plain loop {statistics.median(plains):.1f} s")]


# --- evaluation callbacks -----------------------------------------------------------------------
EVALUATIONS = ("online probe", "kNN", "effective rank", "pictures", "run summary")


def quickstart_evaluations(blocks: Optional[str] = None) -> dict[str, object]:
    """The evaluation callbacks at every validation, in the order of configs/digits_mae.yaml (the
    pictures are the module's own): at their defaults, or with ``blocks="all"`` a probe head and
    a kNN per encoder block as that config sets them."""
    return {"online probe": OnlineLinearProbe(depth=DepthHeads(blocks) if blocks else None),
            "kNN": KNNEvaluator(k=20, every_n_epochs=1, blocks=blocks),
            "effective rank": EffectiveRank(every_n_epochs=1, per_block=True), "run summary": RunSummary()}


def callback_shares(settings: Settings) -> list[Row]:
    """The shares at the callbacks' defaults (the goals) and with the quickstart config's
    per-block probe heads and kNN (``blocks: all``, information)."""
    return _shares(settings, None) + _shares(settings, "all")


def _shares(settings: Settings, blocks: Optional[str]) -> list[Row]:
    """Each evaluation's share of a quickstart run at the SHIPPED cadence (100 epochs, validation
    every 25), from the seconds spent inside its own hooks in a run that validates every epoch,
    over the seconds of the same epochs trained without any evaluation (a separate fit, same
    rounds).

    Both are taken per epoch: the first epoch's one-time costs (the heads and the replay built,
    the first forwards' allocations; on the training side the same) count once per run, the
    later epochs give the steady cost (:func:`over_a_run`). The online probe trains on its own
    step cadence (every ``every_n_steps`` batches): its training hooks count every epoch, its
    validation once per 25 epochs; kNN, effective rank and the pictures once per 25 epochs; the
    run summary once per run. kNN, effective rank and the probe's validation read one shared
    feature pass per dataset (``callbacks/measurement/shared_features.py``): it is charged to the first of
    them that asks, the probe (the quickstart's callback order).
    """
    epochs = settings.pick(4, 2)  # 4 epochs of 11 batches: the probe's every-4th-batch cadence comes round
    validations = SHIPPED_EPOCHS // SHIPPED_EVAL_EVERY
    shares: dict[str, list[float]] = {name: [] for name in EVALUATIONS}
    every_epoch, epoch_seconds, floors = [], [], []
    shipped = OnlineLinearProbe()  # the probe's defaults: its shipped cadence
    with quiet(), tempfile.TemporaryDirectory() as root:
        for _ in range(max(2, settings.rounds // 2) if not settings.quick else 1):
            bare = HookClock()
            bare.span("epoch", "on_train_epoch_start", "on_train_epoch_end")
            timed_fit(lambda: (trainer(settings, os.path.join(root, "train"), [bare], epochs, None),
                               quickstart_model(settings, num_reconstructions=0), quickstart_data(settings)))
            clock = HookClock(settings.torch_device)
            callbacks = quickstart_evaluations(blocks)
            for name, callback in callbacks.items():
                clock.watch(name, callback)
            model = quickstart_model(settings)
            clock.watch("pictures", model)
            evaluated = HookClock()
            evaluated.span("epoch", "on_train_epoch_start", "on_train_epoch_end")
            timed_fit(lambda: (trainer(settings, os.path.join(root, "all"), [clock, *callbacks.values(), evaluated],
                                       epochs, 1), model, quickstart_data(settings)))
            per_epoch = over_a_run(bare.per_call("epoch"), SHIPPED_EPOCHS)
            for name in EVALUATIONS:
                training = over_a_run(clock.per_epoch(name, TRAIN_HOOKS, epochs), SHIPPED_EPOCHS)
                validation = over_a_run(clock.per_epoch(name, VALIDATION_HOOKS, epochs), validations)
                end = clock.seconds(name, END_HOOKS)
                shares[name].append(training / per_epoch + validation / (SHIPPED_EVAL_EVERY * per_epoch)
                                    + end / (SHIPPED_EPOCHS * per_epoch))
            every_epoch.append(statistics.mean(evaluated.per_call("epoch")[1:]) / statistics.mean(bare.per_call("epoch")[1:])
                               - 1)
            epoch_seconds.append(per_epoch)
            if blocks is None:
                floors.append(forwards_share(model, shipped, settings, per_epoch))
    cadences = {"online probe": f"{shipped.max_samples} images embedded every {shipped.every_n_steps} steps, "
                                f"{shipped.every_n_steps} head steps on its {shipped.replay.samples}-sample replay; "
                                f"validation every {SHIPPED_EVAL_EVERY} epochs",
                "run summary": f"once per {SHIPPED_EPOCHS}-epoch run"}
    together = [sum(parts) for parts in zip(*shares.values())]
    every = (f"all of them + validation every epoch: +{100 * statistics.median(every_epoch):.0f} % of "
             f"{statistics.median(epoch_seconds):.1f} s/epoch")
    if blocks is not None:  # information: what configs/digits_mae.yaml's per-block evaluation adds
        section = "evaluation callbacks' share, per-block heads and kNN (configs/digits_mae.yaml, blocks: all)"
        return [ratio_row(section, "online probe with a head per block", shares["online probe"], None,
                          cadences["online probe"] + "; a head per encoder block beside the final one", unit="share"),
                ratio_row(section, "all five together, probe and kNN per block", together, None, every, unit="share")]
    rows = []
    for name in EVALUATIONS:
        goal = "<= 0.03" if name == "online probe" else None
        rows.append(ratio_row("evaluation callbacks' share of a quickstart run", f"{name} at the shipped cadence",
                              shares[name], goal, cadences.get(name, f"every {SHIPPED_EVAL_EVERY} epochs")
                              + "; seconds inside its hooks / training seconds", unit="share"))
    rows.append(ratio_row("evaluation callbacks' share of a quickstart run", "all five together at the shipped cadences",
                          together, "<= 0.05", every, unit="share"))
    rows.append(ratio_row("evaluation callbacks' share of a quickstart run",
                          "their forward passes alone (no head, rank, picture or bookkeeping)", floors, None,
                          f"the kNN bank and the validation set every {SHIPPED_EVAL_EVERY} epochs, the probe's "
                          f"{shipped.max_samples} images every {shipped.every_n_steps} steps: what all five cost "
                          "at the least", unit="share"))
    return rows


def forwards_share(model: MaskedAutoencoder, probe: OnlineLinearProbe, settings: Settings,
                   per_epoch: float) -> float:
    """The share of a quickstart run that the evaluations' forward passes alone take at the
    shipped cadences, timed on ``model`` (just trained) right after the fits it is compared
    with: one pass over the kNN bank (the train split, no blocks) and one over the validation
    set (with the blocks, which the per-block effective rank asks for) per validation, as the
    shared feature pass embeds them, and ``probe``'s forward of its images every
    ``every_n_steps`` training steps."""
    data = quickstart_data(settings)
    data.setup("fit")
    batch_size = data.eval_batch_size
    device = settings.torch_device
    passes = []
    for _ in range(2):  # the first pass warms the allocator and the caches up
        synchronize(device)
        start = time.perf_counter()
        collect_features(model, data.bank_dataset, batch_size, gather=False, forward_context=settings.autocast)
        collect_features(model, data.val_dataset, batch_size, with_blocks=True, gather=False,
                         forward_context=settings.autocast)
        synchronize(device)
        passes.append(time.perf_counter() - start)
    loader = data.train_dataloader()
    images = next(iter(loader))[0][: probe.max_samples].to(device)
    probes = []
    for _ in range(12):
        synchronize(device)
        start = time.perf_counter()
        with isolated_eval(model), settings.autocast():
            model.forward_features(images)
        synchronize(device)
        probes.append(time.perf_counter() - start)
    steps_per_epoch = min(len(loader), settings.max_batches or len(loader))
    validation = passes[-1] / (SHIPPED_EVAL_EVERY * per_epoch)
    probing = statistics.median(probes[2:]) * steps_per_epoch / probe.every_n_steps / per_epoch
    return validation + probing


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
