"""Effective rank of representations (the decay paper, section 6; Roy and Vetterli 2007, RankMe of Garrido
et al. 2023).

With singular values ``s_i`` and ``p_i = s_i / sum_j s_j``:

- :func:`entropy`: ``H = -sum_i p_i log p_i`` (natural log; ``0 log 0 = 0``). The paper writes
  this number and calls it the effective rank;
- :func:`effective_rank`: ``exp(H)``, Roy and Vetterli's effective rank, between 1 and the
  number of non-zero singular values.

Two sources of singular values (:func:`singular_values`):

- ``"covariance"`` (the paper): the ``N x N`` sample covariance of the features of ``N``
  samples, ``torch.cov(X)`` for ``X`` of shape ``N x D``: the rows (samples) are the
  variables and the ``D`` feature dimensions the observations, i.e.
  ``C = (X - m 1^T)(X - m 1^T)^T / (D - 1)`` where ``m`` holds each sample's mean over its
  ``D`` features. Its singular values are the squared singular values of the row-centred
  ``X`` divided by ``D - 1`` (computed that way: no ``N x N`` matrix is formed);
- ``"features"`` (RankMe): the singular values of ``X`` itself, uncentred.

:class:`EffectiveRank` computes both numbers on the validation features gathered over all
ranks (optionally per block: the rank-over-depth profile, written to ``rank_per_block.csv``
and drawn as a picture, not logged as metrics); non-finite features (a diverged network) give
NaN and a warning, not an SVD error.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Literal, NamedTuple, Optional

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from callbacks._utils.distributed import broadcast_from_rank_zero, log_identical
from callbacks._utils.feature_collection import collect_features, datamodule_dataset, loader_settings, smoke_test_subset
from callbacks.measurement.shared_features import SharedEvaluation
from lightning_mods.evaluation import metric_names
from lightning_mods.checkpointing import migration
from lightning_mods.checkpointing.atomic_files import write_text_atomically
from lightning_mods.pictures.grids import log_picture
from lightning_mods.run_outputs.run_folder import run_dir
from lightning_mods.run_outputs.to_loggers import send_table
from lightning_mods.evaluation.over_depth import DepthRows, write_pending
from lightning_mods.evaluation.feature_contract import require_blocks
from callbacks.settings_key import SettingsKeyed, check_name
from callbacks.schedule import ScheduledEvaluation, check_every_n_epochs, evaluation_due
from callbacks.cost import PER_VALIDATION

Source = Literal["covariance", "features"]
DTYPES = {"float64": torch.float64, "float32": torch.float32}
SOURCES = ("covariance", "features")
PROFILE_FILE = "rank_per_block.csv"
PROFILE_COLUMNS = ("epoch", "step", "block", "entropy", "effective_rank")
LEGEND_LINES = 8  # more evaluated epochs than this: a colour bar instead of a legend entry per line


class RankMeasures(NamedTuple):
    """``entropy`` H of the normalised singular values and ``effective_rank`` exp(H)."""

    entropy: float
    effective_rank: float


def _check_singular_values(singular_values: torch.Tensor, owner: str) -> None:
    if singular_values.ndim != 1 or len(singular_values) == 0:
        raise ValueError(f"{owner}: singular_values must be a non-empty 1-D tensor, got shape "
                         f"{tuple(singular_values.shape)}")
    if (singular_values < 0).any():
        raise ValueError(f"{owner}: singular_values must be >= 0")


def entropy(singular_values: torch.Tensor) -> torch.Tensor:
    """``H = -sum p_i log p_i`` of ``p_i = s_i / sum s_j`` (a 0-dim tensor in the input dtype).

    An all-zero spectrum (fully collapsed features) gives ``H = 0``.
    """
    _check_singular_values(singular_values, "entropy")
    total = singular_values.sum()
    if total <= 0:
        return singular_values.new_zeros(())
    p = singular_values / total
    return -torch.special.xlogy(p, p).sum()


def effective_rank(singular_values: torch.Tensor) -> torch.Tensor:
    """Roy and Vetterli's effective rank ``exp(entropy(singular_values))`` (0-dim tensor)."""
    return entropy(singular_values).exp()


def singular_values(features: torch.Tensor, source: Source = "covariance",
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Singular values of the paper's ``N x N`` sample covariance or of the ``N x D`` features.

    See the module docstring for the exact matrices. ``dtype``: the precision of the
    decomposition (float64 or float32).
    """
    if source not in SOURCES:
        raise ValueError(f"singular_values: source must be one of {SOURCES}, got {source!r}")
    if dtype not in DTYPES.values():
        raise ValueError(f"singular_values: dtype must be torch.float64 or torch.float32, got {dtype}")
    if features.ndim != 2 or features.shape[0] < 1 or features.shape[1] < 1:
        raise ValueError(f"singular_values: features must be a non-empty N x D matrix, got {tuple(features.shape)}")
    x = features.to(dtype)
    if source == "features":
        return torch.linalg.svdvals(x)
    if features.shape[1] < 2:
        raise ValueError("singular_values: the covariance source needs D >= 2 feature dimensions")
    centred = x - x.mean(dim=1, keepdim=True)
    return torch.linalg.svdvals(centred) ** 2 / (features.shape[1] - 1)


def rank_measures(features: torch.Tensor, source: Source = "covariance",
                  dtype: torch.dtype = torch.float64) -> RankMeasures:
    """Entropy and effective rank of ``features`` (``N x D``) from the chosen ``source``."""
    s = singular_values(features, source, dtype)
    h = entropy(s)
    return RankMeasures(float(h), float(h.exp()))


def draw_rank_profile(profiles: list[tuple[int, list[float]]], title: str = "effective rank over depth"):
    """Line plot of effective rank against block index, one line per ``(epoch, values)`` coloured
    by epoch, the last one drawn in black with markers; a legend names every epoch (a colour bar
    stands for them beyond ``LEGEND_LINES`` lines). Returns a matplotlib ``Figure`` (no pyplot state)."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.6, 3.6), layout="constrained")
    ax = fig.add_subplot()
    epochs = [epoch for epoch, _ in profiles]
    shades = ScalarMappable(Normalize(min(epochs), max(max(epochs), min(epochs) + 1)), colormaps["viridis"])
    named = len(profiles) <= LEGEND_LINES
    for i, (epoch, values) in enumerate(profiles):
        latest = i == len(profiles) - 1
        ax.plot(range(1, len(values) + 1), values, marker="o" if latest else None,
                color="black" if latest else shades.to_rgba(epoch), linewidth=2.0 if latest else 1.2,
                label=f"epoch {epoch}" if named or latest else None)
    ax.set_xlabel("block index (1 = nearest the input)")
    ax.set_ylabel("effective rank exp(H)")
    ax.ticklabel_format(axis="y", useOffset=False)  # a flat profile: values, not "1e-9 + 1.114"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small", title="evaluated after")
    if not named:
        fig.colorbar(shades, ax=ax, label="epoch")
    return fig


def write_profiles(path: Path, history: list[dict[str, Any]]) -> Path:
    """``rank_per_block.csv``: one row per evaluation and block (``PROFILE_COLUMNS``), from
    the entries of :attr:`EffectiveRank.history` that have a profile. Rewritten whole, so a
    resumed run's file holds exactly the evaluations its restored history holds."""
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(PROFILE_COLUMNS)
    for entry in history:
        for block, (h, r) in enumerate(zip(entry["entropy_profile"], entry["profile"]), start=1):
            writer.writerow([entry["epoch"], entry["step"], block, repr(h), repr(r)])
    return write_text_atomically(path, text.getvalue())


def read_profiles(path: Path) -> dict[int, dict[str, list[float]]]:
    """``{epoch: {"entropy": [...], "effective_rank": [...]}}`` (blocks in order) of a
    ``rank_per_block.csv``."""
    profiles: dict[int, dict[str, list[float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            entry = profiles.setdefault(int(row["epoch"]), {"entropy": [], "effective_rank": []})
            entry["entropy"].append(float(row["entropy"]))
            entry["effective_rank"].append(float(row["effective_rank"]))
    return profiles


class EffectiveRank(SettingsKeyed, ScheduledEvaluation):
    """Entropy and effective rank of the gathered validation features after validation epochs.

    Logs ``rank/entropy`` and ``rank/effective_rank`` of the features at the end of every
    ``every_n_epochs``-th validation epoch of ``fit`` (and the last one), and in every
    ``validate``; identical on every rank (rank 0 computes, the others receive). With
    ``per_block`` the profile over depth (both numbers for every block's output) is kept in
    :attr:`last_profile` and :attr:`history`, written (rank 0) to ``<log_dir>/rank_per_block.csv``
    (:func:`read_profiles` reads it back) and drawn as the picture ``rank/profile``: a curve
    per evaluation is read as a picture, not as one logged metric per block. Skips the sanity
    check; under ``fast_dev_run=n`` uses only the first ``n`` batches of the validation set.

    Args:
        every_n_epochs: evaluate after every n-th epoch; None: at every validation
            (``trainer.check_val_every_n_epoch``).
        source: ``"covariance"`` (the paper's N x N sample covariance) or ``"features"`` (RankMe).
        dtype: ``"float64"`` or ``"float32"``, the precision of the SVD.
        per_block: also every block's output (``forward_intermediates``): the profile.
        max_samples: use the first ``max_samples`` validation samples (None: all of them).
        batch_size, num_workers: of the feature loader (default: the datamodule's).
        draw_profile: save the rank-over-depth picture (with ``per_block``).
        name: the tag of this instance's metric names, profile file and picture when the Trainer
            has several ``EffectiveRank`` (default: its settings that differ from the defaults,
            e.g. ``rank/effective_rank@source=features``; :mod:`callbacks.settings_key`).
    """
    cost = PER_VALIDATION

    def __init__(self, every_n_epochs: Optional[int] = None, source: Source = "covariance",
                 dtype: Literal["float64", "float32"] = "float64", per_block: bool = False,
                 max_samples: Optional[int] = None, batch_size: Optional[int] = None,
                 num_workers: Optional[int] = None, draw_profile: bool = True,
                 name: Optional[str] = None) -> None:
        super().__init__()
        self.name = check_name("EffectiveRank", name)
        if source not in SOURCES:
            raise ValueError(f"EffectiveRank: source must be one of {SOURCES}, got {source!r}")
        if dtype not in DTYPES:
            raise ValueError(f"EffectiveRank: dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"EffectiveRank: max_samples must be >= 1 or None, got {max_samples!r}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"EffectiveRank: batch_size must be >= 1 or None, got {batch_size!r}")
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"EffectiveRank: num_workers must be >= 0 or None, got {num_workers!r}")
        self.every_n_epochs = check_every_n_epochs("EffectiveRank", every_n_epochs)
        self.source = source
        self.dtype = dtype
        self.per_block = per_block
        self.max_samples = max_samples
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.draw_profile = draw_profile
        # one entry per evaluation of fit: epoch, step, the logged values and the per-block
        # effective ranks ("profile") and entropies ("entropy_profile")
        self.history: list[dict[str, Any]] = []
        self.over_depth = DepthRows()  # only its flag: the rows come from the history (depth_rows)
        # the last evaluation's per-block values (fit or validate): {"entropy": [...], "effective_rank": [...]}
        self.last_profile: dict[str, list[float]] = {}
        self._validate_entries: list[dict[str, Any]] = []  # the last validate's evaluation

    @property
    def last_metrics(self) -> dict[str, float]:
        """The values logged by the last evaluation (empty before the first)."""
        return dict(self.history[-1]["metrics"]) if self.history else {}

    def identity(self) -> dict[str, Any]:
        return {"source": self.source, "dtype": self.dtype, "per_block": self.per_block,
                "max_samples": self.max_samples}

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        write_pending(trainer)  # the per-block table and picture, once all contributors have added their rows

    def depth_rows(self, trainer: Trainer) -> list[dict[str, Any]]:
        """The per-block ranks as rows of ``eval_per_block.csv`` (:mod:`lightning_mods.evaluation.over_depth`):
        every evaluation of fit, or the last validate's."""
        if not self.per_block:
            return []
        entries = self.history if trainer.state.fn == TrainerFn.FITTING else self._validate_entries
        rows = []
        for entry in entries:
            entropies = entry.get("entropy_profile") or [float("nan")] * len(entry["profile"])
            for block, (h, r) in enumerate(zip(entropies, entry["profile"]), start=1):
                rows.append({"epoch": entry["epoch"], "step": entry["step"], "block": block,
                             self.metric(metric_names.EFFECTIVE_RANK): r, self.metric(metric_names.RANK_ENTROPY): h})
        return rows

    @property
    def profile_file(self) -> str:
        """``rank_per_block.csv``, or ``rank_per_block@<tag>.csv`` beside another instance."""
        stem, _, suffix = PROFILE_FILE.rpartition(".")
        return f"{metric_names.variant(stem, self.instance_tag)}.{suffix}"

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.per_block:
            require_blocks(pl_module, "EffectiveRank: per_block")
        if self.max_samples is None:
            SharedEvaluation.of(trainer).need("val_dataset", self.per_block)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not evaluation_due(trainer, self.every_n_epochs):
            return
        metrics, profile = self.evaluate(trainer, pl_module)
        log_identical(pl_module, metrics)
        entry = {"epoch": int(trainer.current_epoch), "step": int(trainer.global_step), "metrics": metrics,
                 "profile": profile["effective_rank"], "entropy_profile": profile["entropy"]}
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.history.append(entry)
        else:
            self._validate_entries = [entry]
        self.last_profile = profile
        if not self.per_block:
            return
        self.over_depth.unwritten = True  # its profile joins the per-block table
        if not trainer.is_global_zero:
            return
        # validate: Lightning does not restore the fit's history, the file holds this evaluation
        evaluated = [h for h in self.history if h.get("profile")] if fitting else [entry]
        path = write_profiles(run_dir(trainer) / self.profile_file, evaluated)
        send_table(trainer, path, trainer.global_step, run_dir(trainer))
        if self.draw_profile:
            fig = draw_rank_profile([(h["epoch"], h["profile"]) for h in evaluated],
                                    f"effective rank over depth ({self.source} spectrum)")
            log_picture(trainer, self.metric("rank/profile"), fig)

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> tuple[dict[str, float], dict[str, list[float]]]:
        """``(metrics, per-block {"entropy": [...], "effective_rank": [...]})``, the same on every rank
        (empty lists without ``per_block``)."""
        dataset = datamodule_dataset(trainer, "val_dataset", "EffectiveRank")
        batch_size, num_workers = loader_settings(trainer, self.batch_size, self.num_workers)
        if self.max_samples is not None and self.max_samples < len(dataset):
            subset = smoke_test_subset(trainer, torch.utils.data.Subset(dataset, range(self.max_samples)), batch_size)
            collected = collect_features(pl_module, subset, batch_size, num_workers, with_blocks=self.per_block,
                                         forward_context=trainer.precision_plugin.forward_context, trainer=trainer,
                                         description="EffectiveRank: val_dataset")
        else:  # the whole validation set: one pass shared with kNN and the online probe
            collected = SharedEvaluation.of(trainer).features(trainer, pl_module, "val_dataset", "EffectiveRank", batch_size, num_workers,
                                        with_blocks=self.per_block, dataset=dataset)
        matrices = [collected.features] + (collected.blocks or [])
        values = torch.zeros(len(matrices), 2, dtype=torch.float64, device=collected.features.device)
        if trainer.is_global_zero:
            for i, x in enumerate(matrices):
                if not bool(torch.isfinite(x).all()):  # a diverged network: no SVD of NaN (LinAlgError)
                    rank_zero_warn(f"EffectiveRank: non-finite {'features' if i == 0 else f'block {i} features'}"
                                   " at this evaluation; logging NaN")
                    values[i] = float("nan")
                    continue
                values[i] = torch.tensor(rank_measures(x, self.source, DTYPES[self.dtype]), dtype=torch.float64)
        values = broadcast_from_rank_zero(values).cpu()
        metrics = {self.metric(metric_names.RANK_ENTROPY): float(values[0, 0]),
                   self.metric(metric_names.EFFECTIVE_RANK): float(values[0, 1])}
        return metrics, {"entropy": values[1:, 0].tolist(), "effective_rank": values[1:, 1].tolist()}

    def state_dict(self) -> dict[str, Any]:
        return {"history": [dict(h) for h in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = migration.effective_rank_history(state_dict.get("history", []))
