"""Effective rank of representations (SPEC section 6; Roy and Vetterli 2007, RankMe of Garrido
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
ranks (optionally per block: the rank-over-depth profile, drawn as a picture); non-finite
features (a diverged network) give NaN and a warning, not an SVD error.
"""
from __future__ import annotations

from typing import Any, Literal, NamedTuple, Optional

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

from .distributed import broadcast_from_rank_zero, log_identical
from .feature_collection import collect_features, datamodule_dataset, loader_settings, smoke_test_subset
from lightning_mods.pictures import log_picture
from .schedule import ScheduledEvaluation, check_every_n_epochs, evaluation_due

Source = Literal["covariance", "features"]
DTYPES = {"float64": torch.float64, "float32": torch.float32}
SOURCES = ("covariance", "features")


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
    """Line plot of effective rank against block index, one line per ``(epoch, values)``,
    the last one highlighted. Returns a matplotlib ``Figure`` (no pyplot state)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0, 3.4), layout="constrained")
    ax = fig.add_subplot()
    cmap = colormaps["viridis"]
    for i, (epoch, values) in enumerate(profiles):
        latest = i == len(profiles) - 1
        shade = cmap(i / max(1, len(profiles) - 1))
        ax.plot(range(1, len(values) + 1), values, marker="o" if latest else None,
                color="black" if latest else shade, alpha=1.0 if latest else 0.5,
                linewidth=2.0 if latest else 1.0, label=f"epoch {epoch}" if latest or i == 0 else None)
    ax.set_xlabel("block")
    ax.set_ylabel("effective rank exp(H)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    return fig


class EffectiveRank(ScheduledEvaluation):
    """Entropy and effective rank of the gathered validation features after validation epochs.

    Logs ``rank/entropy`` and ``rank/effective_rank`` (and with ``per_block``
    ``rank/block_XX/entropy``, ``rank/block_XX/effective_rank`` for blocks ``XX = 01, 02, ...``
    and the picture ``rank/profile``) at the end of every ``every_n_epochs``-th validation
    epoch of ``fit`` (and the last one), and in every ``validate``; identical on every rank
    (rank 0 computes, the others receive). Skips the sanity check; under ``fast_dev_run=n``
    uses only the first ``n`` batches of the validation set.

    Args:
        every_n_epochs: evaluate after every n-th epoch; None: at every validation
            (``trainer.check_val_every_n_epoch``).
        source: ``"covariance"`` (the paper's N x N sample covariance) or ``"features"`` (RankMe).
        dtype: ``"float64"`` or ``"float32"``, the precision of the SVD.
        per_block: also every block's output (``forward_block_features``): the profile.
        max_samples: use the first ``max_samples`` validation samples (None: all of them).
        batch_size, num_workers: of the feature loader (default: the datamodule's).
        draw_profile: save the rank-over-depth picture (with ``per_block``).
    """

    def __init__(self, every_n_epochs: Optional[int] = None, source: Source = "covariance",
                 dtype: Literal["float64", "float32"] = "float64", per_block: bool = False,
                 max_samples: Optional[int] = None, batch_size: Optional[int] = None,
                 num_workers: Optional[int] = None, draw_profile: bool = True) -> None:
        super().__init__()
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
        # one entry per evaluation: epoch, step, the logged values and the per-block profile
        self.history: list[dict[str, Any]] = []

    @property
    def last_metrics(self) -> dict[str, float]:
        """The values logged by the last evaluation (empty before the first)."""
        return dict(self.history[-1]["metrics"]) if self.history else {}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.per_block and not hasattr(pl_module, "forward_block_features"):
            raise ValueError(f"EffectiveRank: per_block needs {type(pl_module).__name__}.forward_block_features "
                             "(docs/contracts.md)")

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not evaluation_due(trainer, self.every_n_epochs):
            return
        metrics, profile = self.evaluate(trainer, pl_module)
        log_identical(pl_module, metrics)
        if trainer.state.fn == TrainerFn.FITTING:
            self.history.append({"epoch": int(trainer.current_epoch), "step": int(trainer.global_step),
                                 "metrics": metrics, "profile": profile})
        if profile and self.draw_profile and trainer.is_global_zero:
            profiles = [(h["epoch"], h["profile"]) for h in self.history if h["profile"]] \
                or [(int(trainer.current_epoch), profile)]
            fig = draw_rank_profile(profiles, f"effective rank over depth ({self.source})")
            log_picture(trainer, "rank/profile", fig)

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> tuple[dict[str, float], list[float]]:
        """``(metrics, per-block effective ranks)``, the same on every rank."""
        dataset = datamodule_dataset(trainer, "val_dataset", "EffectiveRank")
        if self.max_samples is not None and self.max_samples < len(dataset):
            dataset = torch.utils.data.Subset(dataset, range(self.max_samples))
        batch_size, num_workers = loader_settings(trainer, self.batch_size, self.num_workers)
        dataset = smoke_test_subset(trainer, dataset, batch_size)
        collected = collect_features(pl_module, dataset, batch_size, num_workers, with_blocks=self.per_block,
                                     forward_context=trainer.precision_plugin.forward_context)
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
        metrics = {"rank/entropy": float(values[0, 0]), "rank/effective_rank": float(values[0, 1])}
        for b, (h, r) in enumerate(values[1:].tolist(), start=1):
            metrics[f"rank/block_{b:02d}/entropy"] = h
            metrics[f"rank/block_{b:02d}/effective_rank"] = r
        return metrics, values[1:, 1].tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"history": [dict(h) for h in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(h) for h in state_dict.get("history", [])]
