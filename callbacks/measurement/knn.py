"""Weighted k-nearest-neighbour evaluation of frozen features (the decay paper, section 4, "Evaluation: kNN
with K=20"), the vote of InstDisc (Wu et al. 2018) and DINO (Caron et al. 2021).

For a query ``q`` and the bank features ``b_j`` (both L2-normalised), the cosine similarities
``s_j = q . b_j`` of the ``k`` most similar bank samples vote for their labels with weights
``exp(s_j / T)``; the score of class ``c`` is the sum of the weights of the neighbours of
class ``c``. Ties:

- between bank samples at the k-th similarity: whichever ``torch.topk`` keeps (unspecified);
- between classes with equal scores: the lower class index ranks first (stable sort), so
  ``top-1`` of a tie goes to the smallest label.

:class:`KNNEvaluator` uses the datamodule's ``bank_dataset`` (train split, eval transform) as
the bank and its ``val_dataset`` as queries (docs/contracts.md). Under DDP the bank is gathered
without padding duplicates, each rank scores its own strided shard of the queries, and the
correct counts are summed over ranks: the accuracy is the one-process accuracy, the same on
every rank.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_mods.evaluation import metric_names
from callbacks._utils.distributed import all_reduce_sum, log_identical
from callbacks._utils.feature_collection import loader_settings
from callbacks.measurement.shared_features import SharedEvaluation
from lightning_mods.evaluation.over_depth import DepthRows, check_blocks, resolve_blocks, write_pending
from lightning_mods.evaluation.feature_contract import require_blocks
from callbacks.settings_key import SettingsKeyed, check_name
from callbacks.schedule import ScheduledEvaluation, check_every_n_epochs, evaluation_due
from callbacks.cost import PER_VALIDATION

SIMILARITY_BUDGET = 2 ** 24  # similarity entries per chunk (64 MiB in float32)


def knn_predict(
    bank_feats: torch.Tensor,
    bank_labels: torch.Tensor,
    query_feats: torch.Tensor,
    num_classes: int,
    k: int = 20,
    temperature: float = 0.07,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Class scores ``Q x C`` of the temperature-weighted kNN vote (see the module docstring).

    Args:
        bank_feats: ``N x D`` bank features (any scale: they are L2-normalised here).
        bank_labels: ``N`` integer labels in ``[0, num_classes)``.
        query_feats: ``Q x D`` query features.
        num_classes: number of classes ``C``.
        k: neighbours per query; ``min(k, N)`` are used when the bank is smaller.
        temperature: ``T`` of the weights ``exp(similarity / T)``.
        chunk_size: queries scored at once (default: as many as keep ``chunk x N`` under
            2**24 similarities), so a large bank does not need a ``Q x N`` matrix.
    """
    return knn_predict_ks(bank_feats, bank_labels, query_feats, num_classes, [k], temperature, chunk_size)[0]


def knn_predict_ks(
    bank_feats: torch.Tensor,
    bank_labels: torch.Tensor,
    query_feats: torch.Tensor,
    num_classes: int,
    ks: Sequence[int],
    temperature: float = 0.07,
    chunk_size: Optional[int] = None,
) -> list[torch.Tensor]:
    """:func:`knn_predict` at every ``k`` of ``ks`` from one similarity matrix and one top-k (of
    the largest ``k``): the ``k`` nearest are the first ``k`` of the largest ``k``'s sorted
    neighbours, and their votes are added in the same order, so each score equals the single-``k``
    one. Returns one ``Q x C`` tensor per entry of ``ks``."""
    ks = list(ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"knn_predict: k must be an integer >= 1, got {ks[0] if len(ks) == 1 else ks!r}")
    if not temperature > 0:
        raise ValueError(f"knn_predict: temperature must be > 0, got {temperature!r}")
    if num_classes < 1:
        raise ValueError(f"knn_predict: num_classes must be >= 1, got {num_classes!r}")
    if bank_feats.ndim != 2 or query_feats.ndim != 2 or bank_feats.shape[1] != query_feats.shape[1]:
        raise ValueError(f"knn_predict: bank_feats and query_feats must be N x D and Q x D, got "
                         f"{tuple(bank_feats.shape)} and {tuple(query_feats.shape)}")
    if bank_labels.shape != (bank_feats.shape[0],):
        raise ValueError(f"knn_predict: bank_labels must have shape ({bank_feats.shape[0]},), "
                         f"got {tuple(bank_labels.shape)}")
    if len(bank_labels) == 0:
        raise ValueError("knn_predict: bank_feats is empty")
    if bank_labels.min() < 0 or bank_labels.max() >= num_classes:
        raise ValueError(f"knn_predict: bank_labels must lie in [0, {num_classes}), got "
                         f"[{int(bank_labels.min())}, {int(bank_labels.max())}]")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"knn_predict: chunk_size must be >= 1 or None, got {chunk_size!r}")
    bank = F.normalize(bank_feats.float(), dim=1)
    queries = F.normalize(query_feats.float().to(bank.device), dim=1)
    labels = bank_labels.to(device=bank.device, dtype=torch.int64)
    used = [min(k, len(bank)) for k in ks]
    chunk = chunk_size or max(1, SIMILARITY_BUDGET // len(bank))
    scores = [torch.zeros(len(queries), num_classes, device=bank.device) for _ in ks]
    for start in range(0, len(queries), chunk):
        similarity = queries[start:start + chunk] @ bank.T
        top_sim, top_idx = similarity.topk(max(used), dim=1)  # sorted, most similar first
        weights = (top_sim / temperature).exp()
        voters = labels[top_idx]
        for score, k in zip(scores, used):
            score[start:start + chunk].scatter_add_(1, voters[:, :k], weights[:, :k])
    return scores


def rank_classes(scores: torch.Tensor) -> torch.Tensor:
    """Classes by decreasing score, ties to the lower class index: ``Q x C`` indices."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices


def knn_classify(bank_feats: torch.Tensor, bank_labels: torch.Tensor, query_feats: torch.Tensor,
                 num_classes: int, k: int = 20, temperature: float = 0.07) -> torch.Tensor:
    """Predicted labels ``Q`` of :func:`knn_predict` (ties to the lower class index)."""
    return rank_classes(knn_predict(bank_feats, bank_labels, query_feats, num_classes, k, temperature))[:, 0]


def topk_correct(scores: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)) -> torch.Tensor:
    """Number of queries whose label is among the ``k`` best classes that got a vote, one count
    per ``k``: a class without a vote (score 0) never counts, so with fewer voted classes than
    ``k`` (always when the neighbours are fewer than ``k``) top-``k`` counts only the voted ones,
    as DINO's ``knn_classifier`` (its top-5 at ``k < 5`` neighbours is the top-``k`` accuracy)."""
    ranking = rank_classes(scores)
    labels = labels.to(ranking.device).view(-1, 1)
    voted = scores.gather(1, labels.to(scores.device)).view(-1) > 0  # every vote weighs exp(s / T) > 0
    hits = ranking == labels
    return torch.stack([(hits[:, :k].any(dim=1) & voted.to(hits.device)).sum() for k in ks])


class KNNEvaluator(SettingsKeyed, ScheduledEvaluation):
    """kNN accuracy of ``pl_module.forward_features`` after validation epochs.

    Logs ``knn/top1`` (and ``knn/top5`` when there are more than 5 classes; a class no neighbour
    voted for never counts, so at ``k < 5`` it is the top-``k`` accuracy), identical on every
    rank, at the end of every ``every_n_epochs``-th validation epoch of ``fit`` (and the last
    one), and in every ``validate``. Skips the sanity check; under ``fast_dev_run=n`` uses only
    the first ``n`` batches of the bank and of the queries.

    ``k`` may be a list (DINO reports 10, 20, 100 and 200): every ``k`` is scored from one
    feature pass and one similarity top-k, and logged as ``knn/top1@k=10``, ``knn/top1@k=20``, ...
    With another ``KNNEvaluator`` in the same Trainer the names carry this one's settings too
    (``knn/top1@temperature=0.1``; ``name`` sets that tag), see :mod:`callbacks.settings_key`.

    Args:
        k: neighbours (paper: 20), or a list of them.
        temperature: of the vote weights ``exp(similarity / T)``.
        every_n_epochs: evaluate after every n-th epoch (0-indexed epochs ``n-1, 2n-1, ...``);
            None: at every validation (``trainer.check_val_every_n_epoch``).
        num_classes: classes of the labels (default: the datamodule's ``num_classes``).
        batch_size, num_workers: of the feature loaders (default: the datamodule's).
        chunk_size: queries scored at once (default: bounded by a similarity budget).
        name: the tag of this instance's metric names when the Trainer has several (default:
            its settings that differ from the defaults).
        blocks: also score every chosen block's pooled output (``"all"`` or a list of indices,
            1 = nearest the input, -1 = the last) from the same forward pass: one row per block
            in ``eval_per_block.csv`` and the picture ``eval/over_depth``
            (:mod:`lightning_mods.evaluation.over_depth`); the logged metrics stay those of ``forward_features``.
    """
    cost = PER_VALIDATION

    def __init__(self, k: Union[int, list[int]] = 20, temperature: float = 0.07,
                 every_n_epochs: Optional[int] = None, num_classes: Optional[int] = None,
                 batch_size: Optional[int] = None, num_workers: Optional[int] = None,
                 chunk_size: Optional[int] = None, name: Optional[str] = None,
                 blocks: Union[None, str, list[int]] = None) -> None:
        super().__init__()
        self.blocks = check_blocks("KNNEvaluator", blocks)
        ks = list(k) if isinstance(k, (list, tuple)) else [k]
        if not ks or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in ks):
            raise ValueError(f"KNNEvaluator: k must be an integer >= 1 or a non-empty list of them, got {k!r}")
        if len(set(ks)) != len(ks):
            raise ValueError(f"KNNEvaluator: k lists a value twice: {k!r}")
        if not temperature > 0:
            raise ValueError(f"KNNEvaluator: temperature must be > 0, got {temperature!r}")
        if num_classes is not None and num_classes < 1:
            raise ValueError(f"KNNEvaluator: num_classes must be >= 1 or None, got {num_classes!r}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"KNNEvaluator: batch_size must be >= 1 or None, got {batch_size!r}")
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"KNNEvaluator: num_workers must be >= 0 or None, got {num_workers!r}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"KNNEvaluator: chunk_size must be >= 1 or None, got {chunk_size!r}")
        self.k = list(ks) if isinstance(k, (list, tuple)) else k
        self.temperature = float(temperature)
        self.every_n_epochs = check_every_n_epochs("KNNEvaluator", every_n_epochs)
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.chunk_size = chunk_size
        self.name = check_name("KNNEvaluator", name)
        self.last_metrics: dict[str, float] = {}  # of the last evaluation
        self.last_epoch: Optional[int] = None
        self.over_depth = DepthRows()  # per-block rows of fit's evaluations (in the state) and the last validate's
        self._block_values: list[dict[str, Any]] = []  # of the evaluation in progress

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.blocks is not None:
            require_blocks(pl_module, "KNNEvaluator: blocks")
        for name in ("bank_dataset", "val_dataset"):
            SharedEvaluation.of(trainer).need(name, self.blocks is not None)

    @property
    def ks(self) -> list[int]:
        """The neighbour counts scored (one for an int ``k``)."""
        return list(self.k) if isinstance(self.k, list) else [self.k]

    def identity(self) -> dict[str, Any]:
        return {"k": self.k, "temperature": self.temperature, **({"blocks": self.blocks} if self.blocks else {})}

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        write_pending(trainer)  # the per-block table and picture, once all contributors have added their rows

    def depth_rows(self, trainer: Trainer) -> list[dict[str, Any]]:
        """This instance's per-block rows (:mod:`lightning_mods.evaluation.over_depth`): fit's, or the last validate's."""
        return self.over_depth.rows(trainer)

    def tag_exclusions(self) -> tuple[str, ...]:
        return ("k",) if isinstance(self.k, list) else ()

    def value_tags(self) -> list[str]:
        return [f"k={k}" for k in self.k] if isinstance(self.k, list) else [""]

    def metric_name(self, k: int, top: int) -> str:
        """The logged name of top-``top`` accuracy at ``k`` neighbours."""
        per_k = f"k={k}" if isinstance(self.k, list) else ""
        return self.metric(metric_names.knn_topk(top), per_k)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not evaluation_due(trainer, self.every_n_epochs):
            return
        metrics = self.evaluate(trainer, pl_module)
        log_identical(pl_module, metrics)
        self.last_metrics, self.last_epoch = metrics, int(trainer.current_epoch)
        if self.blocks is not None:
            self.over_depth.record(trainer, [{"epoch": int(trainer.current_epoch), "step": int(trainer.global_step),
                                              **values} for values in self._block_values])

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, float]:
        """``{"knn/top1": ..., ["knn/top5": ...]}`` (per ``k`` for a list) in [0, 1], the same on every rank."""
        dm = getattr(trainer, "datamodule", None)
        num_classes = self.num_classes or getattr(dm, "num_classes", None)
        if not num_classes:
            raise ValueError("KNNEvaluator: num_classes is not set and the datamodule has no num_classes")
        batch_size, num_workers = loader_settings(trainer, self.batch_size, self.num_workers)
        with_blocks = self.blocks is not None
        # one pass per dataset and evaluation, shared with the other evaluation callbacks
        bank = SharedEvaluation.of(trainer).features(trainer, pl_module, "bank_dataset", "KNNEvaluator", batch_size, num_workers,
                               with_blocks=with_blocks)
        queries = SharedEvaluation.of(trainer).features(trainer, pl_module, "val_dataset", "KNNEvaluator", batch_size, num_workers,
                                  with_blocks=with_blocks, gather=False)
        tops = (1, 5) if num_classes > 5 else (1,)
        names = [self.metric_name(k, top) for k in self.ks for top in tops]
        metrics = self._score(bank.features, bank.labels, queries.features, queries.labels, num_classes, names, tops)
        self._block_values = []
        if with_blocks:
            chosen = resolve_blocks("KNNEvaluator", self.blocks, len(bank.blocks))
            for block in chosen:
                values = self._score(bank.blocks[block - 1], bank.labels, queries.blocks[block - 1], queries.labels,
                                     num_classes, names, tops, warn=False)
                norms = all_reduce_sum(torch.stack([queries.blocks[block - 1].double().norm(dim=1).sum(),
                                                    torch.tensor(float(len(queries.labels)), dtype=torch.float64,
                                                                 device=queries.labels.device)]))
                values[metric_names.FEATURE_NORM] = float(norms[0] / norms[1])
                self._block_values.append({"block": block, **values})
        return metrics

    def _score(self, bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor,
               query_labels: torch.Tensor, num_classes: int, names: list[str], tops: tuple[int, ...],
               warn: bool = True) -> dict[str, float]:
        """The accuracies ``names`` (per k, per top) of ``queries`` against ``bank``, summed over ranks."""
        finite = torch.isfinite(bank).all() & torch.isfinite(queries).all()
        if int(all_reduce_sum(finite.logical_not().to(torch.int64).view(1))):  # same answer on every rank
            if warn:
                rank_zero_warn("KNNEvaluator: non-finite features at this evaluation; logging NaN")
            return {name: float("nan") for name in names}
        if len(query_labels):
            all_scores = knn_predict_ks(bank, bank_labels, queries, num_classes, self.ks, self.temperature,
                                        self.chunk_size)
            correct = torch.cat([topk_correct(scores, query_labels, tops) for scores in all_scores])
        else:  # a rank without queries (fewer queries than ranks) still joins the sum
            correct = torch.zeros(len(names), dtype=torch.int64, device=bank.device)
        counts = all_reduce_sum(torch.cat([correct, correct.new_tensor([len(query_labels)])]))
        total = int(counts[-1])
        return {name: int(c) / total for name, c in zip(names, counts[:-1].tolist())}

    def state_dict(self) -> dict[str, Any]:
        return {"last_metrics": dict(self.last_metrics), "last_epoch": self.last_epoch,
                "depth_history": [dict(row) for row in self.over_depth.depth_history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_metrics = dict(state_dict.get("last_metrics", {}))
        self.last_epoch = state_dict.get("last_epoch")
        self.over_depth.depth_history = [dict(row) for row in state_dict.get("depth_history", [])]
