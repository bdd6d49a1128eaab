"""The random number generators' states in the checkpoint, so a resumed fit draws what the
uninterrupted one would have drawn (MAE masks, diffusion noise and timesteps, augmentations in
the main process, dropout).

``state_dict`` captures python ``random``, numpy's global generator, torch's CPU generator and
every CUDA device's generator at the moment the checkpoint is written; ``load_state_dict``
keeps them, and ``on_train_start`` puts them back: after ``seed_everything`` (the CLI seeds
before building the model), the model's initialisation and the sanity check, and before the
first training batch is fetched. The data order is restored by the train loader
(``datamodules.resumable``), which draws nothing from these generators.

Lightning does not checkpoint the running sums behind ``on_epoch=True`` training metrics, so
after a mid-epoch resume ``train/loss_epoch`` and the like would average only the batches after
it. A checkpoint written mid-epoch therefore also keeps, per metric, its running sum and batch
count (a torchmetrics ``Metric`` logged as the value: its states); they are added once every
metric has had its first update after the resume (sums are exact whichever way round), so
the epoch's values are the uninterrupted run's.

Under DDP every rank restores its own states and sums: a checkpoint keeps one entry per global
rank (gathered to rank 0, which writes it); a rank missing from it (a different world size)
keeps its fresh seeding and a warning says the draws differ from the interrupted run's.
"""
from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import Metric

from lightning_mods.checkpointing import checkpoint_io
from lightning_mods._compat import lightning_private
from callbacks.cost import PER_CHECKPOINT


def capture_rng_states() -> dict[str, Any]:
    """This process's generator states (python, numpy, torch CPU, every CUDA device) as
    tensors and plain numbers, so ``torch.load(weights_only=True)`` reads them back."""
    version, internal, gauss = random.getstate()
    key, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"key": key, "state": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_states` captured."""
    py = states["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    npy = states["numpy"]
    np.random.set_state((npy["key"], npy["state"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class ExactResume(Callback):
    """Save every rank's RNG states with each checkpoint and restore them on resume."""
    cost = PER_CHECKPOINT

    def __init__(self) -> None:
        super().__init__()
        self._trainer: Optional[Trainer] = None
        self._pending: Optional[dict[int, dict[str, Any]]] = None  # per rank: RNG states and metric sums
        self._pending_sums: Optional[dict[str, dict[str, Any]]] = None
        self._batch_starts = 0  # training batches begun since the resume
        self._reserved = False  # the checkpoints' host memory allocated (after the first step)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        checkpoint_io.install(trainer)  # checkpoints whole or absent (lightning_mods/checkpointing/checkpoint_io.py)
        untested = lightning_private.untested_lightning_warning()
        if untested and stage == "fit":  # before the first step: a run is not resumed inexactly in silence
            rank_zero_warn(f"ExactResume: {untested}")

    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        mine = {"rng": capture_rng_states(), "epoch_metric_sums": epoch_metric_sums(trainer) if trainer else {}}
        if trainer is None or trainer.world_size == 1 or not torch.distributed.is_initialized():
            return {"ranks": {0: mine}}
        gathered: list[Any] = [None] * trainer.world_size  # every rank dumps the checkpoint, rank 0 writes it
        torch.distributed.all_gather_object(gathered, mine)
        return {"ranks": dict(enumerate(gathered))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = {int(rank): states for rank, states in state_dict.get("ranks", {}).items()}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        mine = pending.get(int(trainer.global_rank))
        if mine is None:
            rank_zero_warn(f"ExactResume: the checkpoint has states for ranks {sorted(pending)}, not for rank "
                           f"{trainer.global_rank}: its random draws and epoch metrics differ from the interrupted "
                           "run's")
            return
        restore_rng_states(mine["rng"])
        self._pending_sums = mine["epoch_metric_sums"] or None
        self._batch_starts = 0

    # --- running sums of on_epoch training metrics (mid-epoch checkpoints) --------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_starts += 1
        if self._pending_sums:
            self._add_pending_sums(trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._reserved and trainer.global_step > 0:  # the optimisers hold their state now
            self._reserved = True
            checkpoint_io.reserve_for_training(trainer)  # the first save need not pin gigabytes

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending_sums:
            self._add_pending_sums(trainer, pl_module, epoch_end=True)

    def _add_pending_sums(self, trainer: Trainer, pl_module: LightningModule, epoch_end: bool = False) -> None:
        # called at every batch start after the resume (and at the end of its epoch): a metric
        # that has appeared since the last call has been updated exactly once since the resume,
        # so its saved sum is added now; one logged only every few batches (the online probe's)
        # waits until it appears, and one that does not appear again in the epoch is logged at
        # its end from the saved sum alone, as the uninterrupted run logs it
        results = lightning_private.epoch_results(trainer)
        waiting: dict[str, dict[str, Any]] = {}
        for key, saved in self._pending_sums.items():
            result = results.get(key)
            if "metric_attribute" in saved and self._batch_starts < 2 and not epoch_end:
                waiting[key] = saved  # a torchmetrics Metric: added once its first update is done
            elif "metric_attribute" in saved:
                metric = pl_module.get_submodule(saved["metric_attribute"])
                states = {name: _to(state, metric.device) for name, state in saved["states"].items()}
                lightning_private.add_metric_states(metric, states)  # current + saved: the whole epoch's sum
            elif result is not None and result.is_tensor:
                result.value = result.value + saved["value"].to(result.value.device)
                if "cumulated_batch_size" in saved:
                    result.cumulated_batch_size = (result.cumulated_batch_size
                                                   + saved["cumulated_batch_size"].to(result.value.device))
            elif not epoch_end:
                waiting[key] = saved
            elif "name" in saved:  # logged anew, then given the saved sums themselves (bit for bit, and
                mean = "cumulated_batch_size" in saved  # synced across ranks as the original was)
                pl_module.log(saved["name"], saved["value"].to(pl_module.device), on_step=False, on_epoch=True,
                              reduce_fx="mean" if mean else "sum", batch_size=1, sync_dist=saved.get("sync_dist", False))
                relogged = results[f"{lightning_private.current_hook_name(pl_module)}.{saved['name']}"]
                relogged.value = saved["value"].to(relogged.value.device)
                if mean:
                    relogged.cumulated_batch_size = saved["cumulated_batch_size"].to(relogged.value.device)
        self._pending_sums = waiting or None


def epoch_metric_sums(trainer: Trainer) -> dict[str, dict[str, Any]]:
    """Running sums of the ``on_epoch`` training metrics of an unfinished epoch (else empty)."""
    loop = trainer.fit_loop.epoch_loop
    if trainer.sanity_checking or loop.batch_progress.is_last_batch:
        return {}
    sums: dict[str, dict[str, Any]] = {}
    for key, result in lightning_private.epoch_results(trainer).items():
        meta = result.meta
        if not meta.on_epoch or result.has_reset or key.startswith("on_train_epoch_end."):
            continue  # (a value logged at the epoch's end is logged whole again at the resumed epoch's end)
        if result.is_tensor and (meta.is_mean_reduction or meta.is_sum_reduction):
            sums[key] = {"value": result.value.detach().cpu().clone(), "name": meta.name,
                         "sync_dist": bool(meta.sync.should)}
            if meta.is_mean_reduction:
                sums[key]["cumulated_batch_size"] = result.cumulated_batch_size.detach().cpu().clone()
        elif isinstance(result.value, Metric) and meta.metric_attribute:
            metric = result.value
            sums[key] = {"metric_attribute": meta.metric_attribute,
                         "states": {name: _detached(getattr(metric, name)) for name in lightning_private.metric_state_names(metric)}}
        else:
            reduce = getattr(meta.reduce_fx, "__name__", meta.reduce_fx)  # torch.max, not its repr
            rank_zero_warn(f"ExactResume: the epoch value of {key!r} (reduced with {reduce}) will cover only the "
                           "batches after a resume from this mid-epoch checkpoint")
    return sums


def _detached(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    return [t.detach().cpu().clone() for t in state]


def _to(state: Any, device: torch.device) -> Any:
    return state.to(device) if isinstance(state, torch.Tensor) else [t.to(device) for t in state]
