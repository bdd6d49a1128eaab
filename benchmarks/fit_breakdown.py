"""Where a fit's time goes, for one config: ``python -m benchmarks --only breakdown`` (the quickstart
configs, on the CPU or ``--device cuda``) and ``make gpu-check ARGS="--parts breakdown"`` (the paper
configs on generated data of their real shapes).

Each figure is in images per second and as a fraction of the first row:

1. **the network's step alone**: the module's own ``training_step`` (forward and loss), backward and
   the package's fused AdamW step, under the fit's precision, on one batch already on the device:
   no Trainer, no loader, no callback, no loader worker alive; warmed up until two successive
   windows of steps agree within 2 % (a GPU step keeps speeding up for hundreds of steps after
   the first few: allocator, autotuning, clocks), the warm-up it took in the table;
   (with ``peer``, also **the official recipe's own training loop** around the same network,
   :mod:`benchmarks.official_loops`, and the fits as ratios to it);
2. **the loader alone**: the config's training loader iterated and each batch copied to the
   device (non-blocking, as Lightning does), nothing trained;
3. **the fit without callbacks**: ``shortcutlab fit`` with ``--trainer.callbacks=[]`` and
   Lightning's default checkpoint off;
4. **the fit as shipped**: ``shortcutlab fit`` with the config's own callbacks;
   (with ``--compile``, also the step with the residual blocks compiled, as ``CompileBlocks``
   does, the step with the whole network captured, as ``CompileNetwork`` does: CUDA graphs on a
   GPU, and the seconds their compiles took; and a fourth fit, as shipped with ``CompileNetwork``:
   the captured step inside the fit, as a ratio to the fit as shipped);
5. **each shipped callback's cost**: the seconds inside its hooks while the timed steps ran,
   per step (synchronised before and after each hook on CUDA, so its GPU work is counted), from
   a third fit; in milliseconds per step and as a share of the step alone's time.

The fits run ``warmup + timed`` steps with validation off, their clock started after ``warmup``;
the data's epoch length says how many epoch ends (and so epoch-end checkpoints) the timed steps
hold, and the table says it. Fits are separate ``shortcutlab fit`` processes, one at a time.
"""
from __future__ import annotations

import functools
import gc
import json
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from .hook_clock import STEP_HOOKS, HookClock
from .settings import Settings
from .timing import Row, skipped, synchronize

REPO = Path(__file__).resolve().parents[1]
SECTION = "where a fit's time goes"
PEERS = {"mae": "facebookresearch/mae", "uvit": "baofff/U-ViT"}


@dataclass
class Case:
    """One config to break down: ``fit_args`` as ``shortcutlab fit`` takes them."""

    name: str
    fit_args: list[str]
    warmup: int
    timed: int
    note: str = ""  # what the data is (generated, its epoch length)
    fits: tuple[str, ...] = ("none", "shipped", "clocked")  # the fits to make (see timed_fit)
    peer: Optional[str] = None  # "mae" or "uvit": also time that paper's own loop (benchmarks.official_loops)


@dataclass
class Breakdown:
    """The figures of one :class:`Case` (images per second; callback seconds per timed step)."""

    case: Case
    batch_size: int = 0
    steps_per_epoch: Optional[int] = None
    step: Optional[float] = None
    step_warmup: Optional[int] = None  # the steps it took the step alone to settle
    peer_loop: Optional[float] = None
    compiled: bool = False  # the compiled figures were asked for (--compile)
    compiled_step: Optional[float] = None
    compile_seconds: Optional[float] = None
    captured_step: Optional[float] = None
    capture_seconds: Optional[float] = None
    loader: Optional[float] = None
    bare_fit: Optional[float] = None
    shipped_fit: Optional[float] = None
    captured_fit: Optional[float] = None
    callback_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


# --- the two callbacks the fits carry ----------------------------------------------------------
class Throughput(Callback):
    """Writes ``{"images_per_s", "peak_memory_gib", "steps", "loss"}`` to ``path``: images per second
    from step ``warmup_steps`` to the end (two synchronisations in all)."""

    def __init__(self, path: str, warmup_steps: int = 20) -> None:
        self.path = path
        self.warmup_steps = warmup_steps
        self._start: Optional[float] = None
        self._images = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warmup_steps and self._start is None:
            synchronize(trainer.strategy.root_device)
            self._start = time.perf_counter()
        if self._start is not None:
            self._images += len(batch[0]) if isinstance(batch, (list, tuple)) else len(batch)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        device = trainer.strategy.root_device
        synchronize(device)
        seconds = time.perf_counter() - self._start if self._start is not None else float("nan")
        logged = trainer.callback_metrics  # the last epoch's mean where the module logs one
        loss = next((logged[k] for k in ("train/loss_epoch", "train/loss", "train/loss_step") if k in logged), None)
        record = {"images_per_s": self._images * trainer.world_size / seconds if self._start else None,
                  "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30
                  if device.type == "cuda" else None,
                  "steps": int(trainer.global_step), "loss": None if loss is None else float(loss),
                  "steps_per_epoch": trainer.num_training_batches
                  if isinstance(trainer.num_training_batches, int) else None}
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(record))


def callback_label(callback: Callback, seen: dict[str, int]) -> str:
    """``type(callback).__name__``, with a ModelCheckpoint's file name and a number for repeats
    (``seen`` counts the names given so far)."""
    name = type(callback).__name__
    if getattr(callback, "filename", None):  # ModelCheckpoint: which one
        name += f"({callback.filename})"
    seen[name] = seen.get(name, 0) + 1
    return name if seen[name] == 1 else f"{name} #{seen[name]}"


class CallbackClock(HookClock):
    """Seconds inside every other callback's hooks while steps ``warmup_steps`` onwards run,
    written to ``path`` as ``{"steps": n, "seconds": {callback: {"per step": s, "per epoch": s}}}``.
    "per epoch" holds the epoch, validation, checkpoint and end hooks; "per step" the others."""

    def __init__(self, path: str, warmup_steps: int = 20) -> None:
        super().__init__(from_step=warmup_steps)
        self.path = path
        self.warmup_steps = warmup_steps

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        names: dict[str, int] = {}
        for callback in trainer.callbacks:
            if callback is self or isinstance(callback, Throughput):
                continue
            self.watch(callback_label(callback, names), callback,
                       [hook for hook in dir(Callback) if hook.startswith("on_") and hook != "on_exception"
                        and getattr(type(callback), hook) is not getattr(Callback, hook)])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        first = self.first_timed_step if self.first_timed_step is not None else trainer.global_step
        seconds: dict[str, dict[str, float]] = {}
        for call in self.calls:
            spent = seconds.setdefault(call.name, {"per step": 0.0, "per epoch": 0.0})
            spent["per step" if call.hook in STEP_HOOKS else "per epoch"] += call.seconds
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps({"steps": int(trainer.global_step) - first, "seconds": seconds}))


# --- the five measurements ---------------------------------------------------------------------
def fit(args: list[str], out: Path, steps: int, precision: str, accelerator: str, extra: list[str],
        devices: int = 1, timeout: Optional[float] = None) -> dict:
    """One ``shortcutlab fit`` process of ``steps`` steps, validation off; its exit status, seconds
    and last error line (stopped after ``timeout`` seconds if given)."""
    command = [sys.executable, "-m", "cli", "fit", *args, f"--trainer.max_steps={steps}",
               "--trainer.max_epochs=-1", f"--trainer.accelerator={accelerator}", f"--trainer.devices={devices}",
               f"--trainer.precision={precision}", f"--trainer.default_root_dir={out}",
               "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0", *extra]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(command[2:]), "status": None, "seconds": round(time.perf_counter() - start, 1),
                "error": f"stopped at the time limit after {timeout:.0f} s"}
    result = {"command": " ".join(command[2:]), "status": done.returncode,
              "seconds": round(time.perf_counter() - start, 1)}
    if done.returncode != 0:
        result["error"] = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
    return result


def timed_fit(case: Case, out: Path, settings: Settings, callbacks: str, timeout: Optional[float] = None) -> dict:
    """A fit of ``case`` with ``callbacks``: ``"none"``, ``"shipped"``, ``"captured"`` (shipped plus
    ``CompileNetwork``) or ``"clocked"`` (shipped plus :class:`CallbackClock`); its
    :class:`Throughput` record (and the clock's) merged in."""
    out.mkdir(parents=True, exist_ok=True)
    record, clock = out / "throughput.json", out / "clock.json"
    extra = ["--trainer.callbacks=[]", "--trainer.enable_checkpointing=false"] if callbacks == "none" else []
    extra += ["--trainer.callbacks+=benchmarks.fit_breakdown.Throughput", f"--trainer.callbacks.path={record}",
              f"--trainer.callbacks.warmup_steps={case.warmup}"]
    if callbacks == "captured":
        extra += ["--trainer.callbacks+=callbacks.training.compile.CompileNetwork"]
    if callbacks == "clocked":
        extra += ["--trainer.callbacks+=benchmarks.fit_breakdown.CallbackClock", f"--trainer.callbacks.path={clock}",
                  f"--trainer.callbacks.warmup_steps={case.warmup}"]
    accelerator = "gpu" if settings.on_cuda else "cpu"
    result = fit(case.fit_args, out, case.warmup + case.timed, settings.precision, accelerator, extra,
                 timeout=timeout)
    if result["status"] == 0 and record.is_file():
        result.update(json.loads(record.read_text()))
    if result["status"] == 0 and clock.is_file():
        result["clock"] = json.loads(clock.read_text())
    return result


def built(case: Case, settings: Settings) -> tuple[LightningModule, Any]:
    """The config's model and datamodule, as ``shortcutlab fit`` builds them (nothing run)."""
    from lightning.pytorch import LightningDataModule

    from commands.lightning_cli import ShortcutLabCLI

    accelerator = "gpu" if settings.on_cuda else "cpu"
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = ShortcutLabCLI(LightningModule, LightningDataModule, subclass_mode_model=True,
                             subclass_mode_data=True, run=False, save_config_callback=None,
                             args=[*case.fit_args, f"--trainer.accelerator={accelerator}", "--trainer.devices=1",
                                   f"--trainer.default_root_dir={root}", "--trainer.logger=false"])
    return cli.model, cli.datamodule


STABLE_WITHIN = 0.02  # two successive windows of the step alone this close: warm
MAX_WINDOWS = 40


def settled_rate(step: Callable[[int], None], batch_size: int, device: torch.device, warmup: int,
                 window: int, max_windows: int = MAX_WINDOWS,
                 clock: Callable[[], float] = time.perf_counter) -> tuple[float, int]:
    """``(images per second, warm-up steps taken)`` of ``step``: after ``warmup`` steps, windows of
    ``window`` steps until two successive ones agree within :data:`STABLE_WITHIN` (at most
    ``max_windows``); the rate is the two windows' together, timed by ``clock``."""
    for index in range(warmup):
        step(index)
    done, previous = warmup, None
    for _ in range(max_windows):
        synchronize(device)
        start = clock()
        for index in range(window):
            step(done + index)
        synchronize(device)
        seconds = clock() - start
        done += window
        if previous is not None and abs(seconds - previous) <= STABLE_WITHIN * min(seconds, previous):
            return 2 * window * batch_size / (seconds + previous), done - 2 * window
        previous = seconds
    return window * batch_size / previous, done - window


def network_step(model: LightningModule, batch: Any, settings: Settings) -> Callable[[int], None]:
    """One step of forward + loss (``training_step``), backward and a fused AdamW step on
    ``batch``, already on the device (``self.log`` without a Trainer: warnings silenced)."""
    from lightning_mods.recipe.optim import adamw, param_groups_weight_decay

    model.to(settings.torch_device).train()
    optimizer = adamw(param_groups_weight_decay(model, 0.05), lr=1e-4)

    def step(index: int) -> None:
        with settings.autocast(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = model.training_step(batch, index)
        loss = loss["loss"] if isinstance(loss, dict) else loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def step_alone(model: LightningModule, batch: Any, settings: Settings, warmup: int, timed: int) -> float:
    """Images per second of :func:`network_step` after ``warmup`` steps, over ``timed`` steps."""
    step = network_step(model, batch, settings)
    for index in range(warmup):
        step(index)
    synchronize(settings.torch_device)
    start = time.perf_counter()
    for index in range(timed):
        step(warmup + index)
    synchronize(settings.torch_device)
    return timed * len(batch[0]) / (time.perf_counter() - start)


def settled_step_alone(model: LightningModule, batch: Any, settings: Settings, warmup: int,
                       window: int) -> tuple[float, int]:
    """``(images per second, warm-up steps)`` of :func:`network_step`, warmed up until two
    successive windows of ``window`` steps agree (:func:`settled_rate`): the table's figure."""
    return settled_rate(network_step(model, batch, settings), len(batch[0]), settings.torch_device, warmup, window)


def peer_loop(case: Case, model: LightningModule, data: Any, settings: Settings) -> float:
    """Images per second of the official recipe's own loop (``case.peer``) around ``model``, on
    the config's data folder."""
    from . import official_loops

    if case.peer == "mae":
        return official_loops.mae_loop(model, Path(data.data_dir) / "train", data.image_size, data.batch_size,
                                       data.num_workers, settings, case.warmup, case.timed)
    if case.peer == "uvit":
        return official_loops.uvit_loop(model, Path(data.data_dir), data.batch_size, official_loops.UVIT_WORKERS,
                                        settings, case.warmup, case.timed)
    raise ValueError(f"fit_breakdown: unknown peer {case.peer!r}")


def compiled_step_alone(model: LightningModule, compiler: Callback, batch: Any, settings: Settings, warmup: int,
                        timed: int) -> tuple[float, float]:
    """:func:`step_alone` with ``model`` compiled in place by ``compiler`` (``CompileBlocks`` or
    ``CompileNetwork``, as in a fit); its images per second and the seconds of its warm-up steps
    (the compiles, and on a GPU under ``CompileNetwork`` the graphs' capture)."""
    compiler.setup(None, model, "fit")
    start = time.perf_counter()
    step_alone(model, batch, settings, max(warmup, 3), 1)  # the compiles (forward and backward)
    compile_seconds = time.perf_counter() - start
    return step_alone(model, batch, settings, 2, timed), compile_seconds


def compiled_figures(case: Case, settings: Settings, batch: Any, result: Breakdown) -> None:
    """The step alone with the blocks compiled and with the network captured, each on a fresh copy
    of the network (the official loop keeps the eager one); a failure is kept as an error."""
    from callbacks.training.compile import CompileBlocks, CompileNetwork

    for label, compiler, fields in (("blocks compiled", CompileBlocks(), ("compiled_step", "compile_seconds")),
                                    ("network captured", CompileNetwork(), ("captured_step", "capture_seconds"))):
        try:
            fresh, _ = built(case, settings)
            figures = compiled_step_alone(fresh, compiler, batch, settings, case.warmup, case.timed)
            for name, value in zip(fields, figures):
                setattr(result, name, value)
        except Exception as err:  # noqa: BLE001 (the error goes into the table)
            result.errors.append(f"{label}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
        finally:
            fresh = None
            torch._dynamo.reset()  # the compiled code goes with the copy it was made for


def fits_made(case: Case, compiled: bool) -> tuple[str, ...]:
    """The fits a breakdown makes: the case's, and with ``compiled`` the shipped one captured."""
    return case.fits + (("captured",) if compiled and "shipped" in case.fits else ())


def loader_alone(loader: Any, to_device: Callable[[Any], Any], settings: Settings, warmup: int, timed: int) -> float:
    """Images per second of the loader's batches through ``to_device`` (the datamodule's
    ``transfer_batch_to_device``: a copy, or a decode on the device), a new epoch's iterator where
    one ends; the worker start-up is inside the ``warmup`` batches."""
    def batches():
        while True:
            yield from loader

    stream = batches()
    for _ in range(warmup):
        to_device(next(stream))
    synchronize(settings.torch_device)
    start, images = time.perf_counter(), 0
    for _ in range(timed):
        batch = to_device(next(stream))
        images += len(batch[0])
    synchronize(settings.torch_device)
    return images / (time.perf_counter() - start)


TIME_LIMIT = "not run: the time limit had passed"


def seconds_left(deadline: Optional[float]) -> Optional[float]:
    """Seconds to ``deadline`` (a ``time.monotonic()`` value; None: no limit), at least 0."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def measure(case: Case, settings: Settings, scratch: Path, deadline: Optional[float] = None) -> Breakdown:
    """The five figures of ``case``; a figure that failed is None, its error kept. Past
    ``deadline`` (``time.monotonic()``) no figure starts, and a fit running then is stopped."""
    result = Breakdown(case, compiled=settings.compile)
    if seconds_left(deadline) == 0:
        result.errors.append(TIME_LIMIT)
        return result
    try:
        model, data = built(case, settings)
        data.prepare_data()
        data.setup("fit")
        to_device = functools.partial(data.transfer_batch_to_device, device=settings.torch_device, dataloader_idx=0)
        loader = data.train_dataloader()
        result.batch_size = loader.batch_size
        result.steps_per_epoch = len(loader)
        batch = to_device(next(iter(loader)))
        del loader  # its workers end: the step alone runs with none alive
        gc.collect()
        result.step, result.step_warmup = settled_step_alone(model, batch, settings, case.warmup,
                                                             max(2, min(case.timed, 20)))
        if settings.compile and seconds_left(deadline) != 0:
            compiled_figures(case, settings, batch, result)
        loader = data.train_dataloader()
        result.loader = loader_alone(loader, to_device, settings, max(2, case.warmup // 4), case.timed)
        del loader, batch
        gc.collect()
        if case.peer and seconds_left(deadline) != 0:
            result.peer_loop = peer_loop(case, model, data, settings)
        del model, data
    except Exception as err:  # noqa: BLE001 (the error goes into the table)
        result.errors.append(f"step/loader: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    finally:
        if settings.on_cuda:
            torch.cuda.empty_cache()
    for callbacks in fits_made(case, settings.compile):
        if seconds_left(deadline) == 0:
            result.errors.append(f"fit ({callbacks}): {TIME_LIMIT}")
            continue
        record = timed_fit(case, scratch / f"{callbacks}", settings, callbacks, timeout=seconds_left(deadline))
        if record["status"] != 0:
            result.errors.append(f"fit ({callbacks}): {record.get('error')}")
            continue
        if callbacks == "none":
            result.bare_fit = record.get("images_per_s")
        elif callbacks == "shipped":
            result.shipped_fit = record.get("images_per_s")
            result.steps_per_epoch = record.get("steps_per_epoch") or result.steps_per_epoch
        elif callbacks == "captured":
            result.captured_fit = record.get("images_per_s")
        else:
            clock = record.get("clock") or {}
            steps = max(1, clock.get("steps", 0))
            result.callback_seconds = {name: {kind: seconds / steps for kind, seconds in spent.items()}
                                       for name, spent in clock.get("seconds", {}).items()}
    return result


# --- the rows ----------------------------------------------------------------------------------
def took(what: str, value: Optional[float]) -> str:
    return "" if value is None else f"{what} took {value:.0f} s"


def rows(breakdown: Breakdown) -> list[Row]:
    """The table rows of one case: img/s in ``raw``, the fraction of the step alone as the value."""
    case, section = breakdown.case, f"{SECTION}: {breakdown.case.name}"
    epochs = (f"{case.timed / breakdown.steps_per_epoch:.2f} epochs" if breakdown.steps_per_epoch
              else "epoch length unknown")
    context = (f"batch {breakdown.batch_size}, {case.timed} timed steps after {case.warmup} = {epochs} "
               f"({breakdown.steps_per_epoch} steps each){'; ' + case.note if case.note else ''}")
    step = breakdown.step
    out = []
    warm = f"warmed up {breakdown.step_warmup} steps (until two windows agreed within 2 %); " \
        if breakdown.step_warmup is not None else ""
    peer = breakdown.peer_loop
    figures = (("the network's step alone (batch on the device, fused AdamW)", breakdown.step, warm + context),
               ("the training loader alone (to the device, nothing trained)", breakdown.loader, ""),
               *(((f"the official recipe's own training loop ({PEERS[case.peer]})", peer,
                   "same network, its own data pipeline and loop"),) if case.peer else ()),
               *((("the network's step alone, residual blocks compiled (CompileBlocks)", breakdown.compiled_step,
                   took("compiling", breakdown.compile_seconds)),
                  ("the network's step alone, captured (CompileNetwork)", breakdown.captured_step,
                   took("compiling and capturing", breakdown.capture_seconds))) if breakdown.compiled else ()),
               ("the fit without callbacks", breakdown.bare_fit, ""),
               ("the fit as shipped", breakdown.shipped_fit, ""),
               *((("the fit as shipped, network captured (CompileNetwork)", breakdown.captured_fit,
                   f"{breakdown.captured_fit / breakdown.shipped_fit:.2f}x the fit as shipped"
                   if breakdown.captured_fit and breakdown.shipped_fit else ""),) if breakdown.compiled else ()))
    made = {"the fit without callbacks": "none", "the fit as shipped": "shipped",
            "the fit as shipped, network captured (CompileNetwork)": "captured"}
    for name, rate, detail in figures:
        if name in made and made[name] not in fits_made(case, breakdown.compiled):
            continue
        if rate is None:
            out.append(skipped(section, name, "; ".join(breakdown.errors) or "not measured"))
            continue
        fraction = rate / step if step else None
        if peer and name in made:
            detail = f"{rate / peer:.2f}x the official loop" + (f"; {detail}" if detail else "")
        out.append(Row(section, name, fraction, fraction, None, "x",
                       f"{rate:.1f} img/s" + (f"; {detail}" if detail else ""),
                       {"images_per_s": rate, **({"of_official_loop": rate / peer} if peer and name in made else {})}))
    step_seconds = breakdown.batch_size / step if step else None
    for callback, spent in sorted(breakdown.callback_seconds.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(spent.values())
        share = total / step_seconds if step_seconds else None
        out.append(Row(section, f"callback {callback}", share, share, None, "share",
                       f"{1e3 * total:.2f} ms a step ({1e3 * spent['per step']:.2f} in per-step hooks, "
                       f"{1e3 * spent['per epoch']:.2f} in epoch, checkpoint and end hooks)",
                       {"seconds_per_step": spent}))
    return out


def markdown(rows_: list[Row]) -> list[str]:
    """The rows as Markdown tables, one per case: img/s, the fraction of the step alone, detail."""
    lines, section = [], None
    for row in rows_:
        if row.section != section:
            section = row.section
            lines += ["", f"### {section.split(': ', 1)[-1]}", "",
                      "| figure | img/s | / step alone | detail |", "|---|---|---|---|"]
        rate = row.raw.get("images_per_s")
        value = "-" if row.median is None else (f"{100 * row.median:.1f} % of a step" if row.unit == "share"
                                                 else f"{row.median:.3f}")
        lines.append(f"| {row.name} | {'-' if rate is None else f'{rate:.1f}'} | {value} | {row.detail} |")
    return lines


def quickstart_cases(settings: Settings) -> list[Case]:
    """The CPU (and any-device) cases: the quickstart MAE and the quick U-ViT on the digits."""
    warmup, timed = settings.pick((5, 30), (2, 4))
    cases = [Case("quickstart MAE (configs/digits_mae.yaml)", ["--config=configs/digits_mae.yaml"], warmup, timed,
                  "the bundled digits")]
    if not settings.quick:
        cases.append(Case("quick U-ViT (configs/digits_diffusion_quick.yaml)",
                          ["--config=configs/digits_diffusion_quick.yaml"], warmup, timed, "the bundled digits"))
    return cases


def run_cases(cases: list[Case], settings: Settings,
              after_case: Callable[[list[Row]], None] = lambda rows_so_far: None,
              deadline: Optional[float] = None) -> list[Row]:
    """The rows of every case, in order; ``after_case(rows so far)`` after each (to write them).
    Past ``deadline`` (``time.monotonic()``) the figures not started are rows that say so."""
    out: list[Row] = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, case in enumerate(cases):
            breakdown = measure(case, settings, Path(scratch) / str(index), deadline)
            print(f"breakdown: {case.name}: step {breakdown.step}, loader {breakdown.loader}, fit without "
                  f"callbacks {breakdown.bare_fit}, shipped {breakdown.shipped_fit} img/s"
                  + (f"; errors: {breakdown.errors}" if breakdown.errors else ""), file=sys.stderr)
            out += rows(breakdown)
            after_case(out)
    return out


def run(settings: Settings) -> list[Row]:
    return run_cases(quickstart_cases(settings), settings)
