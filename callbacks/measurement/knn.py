"""Weighted k-nearest-neighbour evaluation of frozen features (the decay paper, section 4, "Evaluation: kNN
with K=20"), the vote of InstDisc (Wu et al. 2018) and DINO (Caron et al. 2021).

For a query ``q`` and the bank features ``b_j`` (both L2-normalised), the cosine similarities
``s_j = q . b_j`` of the ``k`` most similar bank samples vote for their labels with weights
``exp(s_j / T)``; the score of class ``c`` is the sum of the weights of the neighbours of
class ``c``. Ties:

- between bank samples at the same similarity: the lower bank index (its place in
  ``bank_dataset``) ranks first, so a tie at the k-th place goes to the same sample whatever the
  number of processes;
- between classes with equal scores: the lower class index ranks first (stable sort), so
  ``top-1`` of a tie goes to the smallest label.

:class:`KNNEvaluator` uses the datamodule's ``bank_dataset`` (train split, eval transform) as
the bank and its ``val_dataset`` as queries (docs/contracts.md). Under DDP the bank is sharded:
each rank keeps only the rows it embedded (in the dtype and on the device you choose), scores
every query against them, and the ranks' top-k are merged into the global top-k
(:mod:`callbacks.measurement.knn_scoring`): the accuracy is the one-process accuracy to the last
digit, the same on every rank, and each rank holds ``1 / W`` of the bank. Before the first feature pass the run
stops in one line when the bank would not fit (:mod:`callbacks.measurement.knn_bank`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_mods.evaluation import metric_names
from lightning_mods.evaluation._eval_mode import module_device
from callbacks._utils.distributed import all_reduce_sum, block_shard, log_identical, rank_and_world_size
from callbacks._utils.feature_collection import (Storage, datamodule_dataset, feature_widths, loader_settings,
                                                 smoke_test_subset)
from callbacks.measurement.knn_bank import (BANK_DEVICES, BANK_DTYPES, BankTooLarge, bank_shortage,
                                            remove_other_shards, save_queries, save_shard)
from callbacks.measurement.knn_scoring import (DEFAULT_SCORING_BYTES, all_finite, correct_counts, local_neighbours,
                                               merge_across_ranks, neighbour_count, normalized_queries, rank_classes,
                                               vote)
from callbacks.measurement.shared_features import SharedEvaluation
from lightning_mods.evaluation.over_depth import DepthRows, check_blocks, resolve_blocks, write_pending
from lightning_mods.evaluation.feature_contract import require_blocks
from callbacks.settings_key import SettingsKeyed, check_name
from callbacks.schedule import ScheduledEvaluation, check_every_n_epochs, evaluation_due
from callbacks.cost import PER_VALIDATION

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
        chunk_size: queries scored at once (default: as many as keep their ``chunk x N``
            similarities within 256 MiB), so a large bank does not need a ``Q x N`` matrix.
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
    queries = normalized_queries(query_feats, bank.device)
    budget = chunk_size * len(bank) * 4 if chunk_size else DEFAULT_SCORING_BYTES
    found = local_neighbours(bank, bank_labels.to(bank.device), queries, neighbour_count(ks, len(bank)), budget)
    return [vote(found.sims, found.labels, num_classes, min(k, len(bank)), temperature) for k in ks]


def knn_classify(bank_feats: torch.Tensor, bank_labels: torch.Tensor, query_feats: torch.Tensor,
                 num_classes: int, k: int = 20, temperature: float = 0.07) -> torch.Tensor:
    """Predicted labels ``Q`` of :func:`knn_predict` (ties to the lower class index)."""
    return rank_classes(knn_predict(bank_feats, bank_labels, query_feats, num_classes, k, temperature))[:, 0]


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
        chunk_size: queries scored at once (default: as many as ``scoring_mib`` holds).
        name: the tag of this instance's metric names when the Trainer has several (default:
            its settings that differ from the defaults).
        blocks: also score every chosen block's pooled output (``"all"`` or a list of indices,
            1 = nearest the input, -1 = the last) from the same forward pass: one row per block
            in ``eval_per_block.csv`` and the picture ``eval/over_depth``
            (:mod:`lightning_mods.evaluation.over_depth`); the logged metrics stay those of ``forward_features``.
        bank_dtype: how the bank is stored: ``float32`` (default: exact), ``float16`` or
            ``bfloat16`` (half the memory; near-collapsed features, whose similarities crowd
            near 1, can change neighbours). Similarities are computed in float32 either way.
        bank_device: where the bank is kept: None (the module's device) or ``cpu`` (host memory,
            brought to the module's device a chunk at a time for scoring).
        scoring_mib: work memory of the scoring, in MiB: it sets how many queries are scored
            against the bank at once (more reads the bank fewer times).
        save_features: a folder to write the bank at each evaluation (``bank-rank*-of-*.pt``, one
            file a rank) and the queries (``queries.pt``), for ``shortcutlab score-bank`` to score at
            another ``k``, temperature or set of blocks without embedding the training set again.
    """
    cost = PER_VALIDATION

    def __init__(self, k: Union[int, list[int]] = 20, temperature: float = 0.07,
                 every_n_epochs: Optional[int] = None, num_classes: Optional[int] = None,
                 batch_size: Optional[int] = None, num_workers: Optional[int] = None,
                 chunk_size: Optional[int] = None, name: Optional[str] = None,
                 blocks: Union[None, str, list[int]] = None, bank_dtype: str = "float32",
                 bank_device: Optional[str] = None, scoring_mib: int = 256,
                 save_features: Optional[str] = None) -> None:
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
        if bank_dtype not in BANK_DTYPES:
            raise ValueError(f"KNNEvaluator: bank_dtype must be one of {', '.join(BANK_DTYPES)}, got {bank_dtype!r}")
        if bank_device not in BANK_DEVICES:
            raise ValueError(f"KNNEvaluator: bank_device must be null (the module's device) or 'cpu', got {bank_device!r}")
        if isinstance(scoring_mib, bool) or not isinstance(scoring_mib, int) or scoring_mib < 1:
            raise ValueError(f"KNNEvaluator: scoring_mib must be an integer >= 1, got {scoring_mib!r}")
        self.bank_dtype, self.bank_device, self.scoring_mib = bank_dtype, bank_device, scoring_mib
        self.save_features = save_features
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
        self._checked_for: Optional[str] = None  # the trainer function whose bank was checked to fit

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.blocks is not None:
            require_blocks(pl_module, "KNNEvaluator: blocks")
        for name in ("bank_dataset", "val_dataset"):
            SharedEvaluation.of(trainer).need(name, self.blocks is not None)

    @property
    def storage(self) -> Storage:
        """How the bank is kept: unit-length rows in ``bank_dtype`` on ``bank_device``."""
        return Storage(BANK_DTYPES[self.bank_dtype], self.bank_device, normalize=True)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.check_memory(trainer, pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.check_memory(trainer, pl_module)

    def check_memory(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Stop in one line (:class:`~callbacks.measurement.knn_bank.BankTooLarge`) on every rank
        when any rank's bank, queries and scoring memory would not fit, before any feature pass;
        once per ``fit`` or ``validate``."""
        if self._checked_for == str(trainer.state.fn):
            return
        self._checked_for = str(trainer.state.fn)
        bank, queries = self.evaluated_sets(trainer)
        widths = feature_widths(pl_module, bank, self.blocks is not None)
        device = module_device(pl_module)
        _, world_size = rank_and_world_size()
        shortage = bank_shortage("KNNEvaluator", len(bank), world_size, max(1, int(trainer.num_devices)), widths,
                                 BANK_DTYPES[self.bank_dtype],
                                 torch.device(self.bank_device) if self.bank_device else device, len(queries), device,
                                 self.scoring_bytes(len(bank)), block=loader_settings(trainer, self.batch_size, None)[0])
        # the same decision on every rank: one rank's shortage stops them all
        if int(all_reduce_sum(torch.tensor([0 if shortage is None else 1], device=device))):
            raise BankTooLarge(shortage or "KNNEvaluator: the bank does not fit on another rank; its error names "
                                           "the settings that fix it")

    def evaluated_sets(self, trainer: Trainer) -> tuple[Any, Any]:
        """``(bank, queries)`` as an evaluation reads them (the first batches under ``fast_dev_run``)."""
        batch_size, _ = loader_settings(trainer, self.batch_size, self.num_workers)
        return tuple(smoke_test_subset(trainer, datamodule_dataset(trainer, name, "KNNEvaluator"), batch_size)
                     for name in ("bank_dataset", "val_dataset"))

    def scoring_bytes(self, bank_rows: int) -> int:
        """The scoring's work memory: ``chunk_size`` queries' similarities when it is set."""
        return self.chunk_size * max(1, bank_rows) * 4 if self.chunk_size else self.scoring_mib * 2 ** 20

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
        # one pass per dataset and evaluation, shared with the other evaluation callbacks; the bank
        # stays sharded (each rank its own rows), the queries are gathered (every rank scores all)
        shared = SharedEvaluation.of(trainer)
        bank = shared.features(trainer, pl_module, "bank_dataset", "KNNEvaluator", batch_size, num_workers,
                               with_blocks=with_blocks, gather=False, storage=self.storage)
        queries = shared.features(trainer, pl_module, "val_dataset", "KNNEvaluator", batch_size, num_workers,
                                  with_blocks=with_blocks)
        bank_total = len(self.evaluated_sets(trainer)[0])  # every rank's rows together
        if self.save_features:
            self.write_features(trainer, bank, queries, bank_total, num_classes, batch_size)
        tops = (1, 5) if num_classes > 5 else (1,)
        names = [self.metric_name(k, top) for k in self.ks for top in tops]
        rank, world_size = rank_and_world_size()
        bank_index = torch.tensor(block_shard(bank_total, rank, world_size, batch_size), dtype=torch.int64)
        layout = (bank_index, batch_size)  # the bank's rows in the whole bank, in blocks of one batch
        metrics = self._score(bank.features, bank.labels, queries.features, queries.labels, num_classes, names, tops,
                              bank_total, layout)
        self._block_values = []
        if with_blocks:
            chosen = resolve_blocks("KNNEvaluator", self.blocks, len(bank.blocks))
            for block in chosen:
                values = self._score(bank.blocks[block - 1], bank.labels, queries.blocks[block - 1], queries.labels,
                                     num_classes, names, tops, bank_total, layout, warn=False)
                values[metric_names.FEATURE_NORM] = float(queries.blocks[block - 1].double().norm(dim=1).mean())
                self._block_values.append({"block": block, **values})
        return metrics

    def _score(self, bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor,
               query_labels: torch.Tensor, num_classes: int, names: list[str], tops: tuple[int, ...],
               bank_total: int, layout: tuple[torch.Tensor, int], warn: bool = True) -> dict[str, float]:
        """The accuracies ``names`` (per k, per top) of every query against the bank, whose rows
        are split over the ranks (``bank_total`` in all; ``layout``: this rank's rows' indices in
        the whole bank and the rows of a block), the same on every rank and at every world size."""
        finite = all_finite(bank) and all_finite(queries)
        if int(all_reduce_sum(torch.tensor([0 if finite else 1], device=queries.device))):  # same answer everywhere
            if warn:
                rank_zero_warn("KNNEvaluator: non-finite features at this evaluation; logging NaN")
            return {name: float("nan") for name in names}
        budget = self.scoring_bytes(len(bank))
        normalized = normalized_queries(queries, queries.device)
        bank_index, block_rows = layout
        found = local_neighbours(bank, bank_labels, normalized, neighbour_count(self.ks, bank_total), budget,
                                 bank_index=bank_index, block_rows=block_rows)
        found = merge_across_ranks(found, budget)
        ks = [min(k, bank_total) for k in self.ks]
        correct = correct_counts(found.sims, found.labels, query_labels.to(found.sims.device), num_classes, ks,
                                 self.temperature, tops, budget)
        return {name: int(c) / len(query_labels) for name, c in zip(names, correct.tolist())}

    def write_features(self, trainer: Trainer, bank: Any, queries: Any, bank_total: int, num_classes: int,
                       block_rows: int) -> None:
        """``save_features``: this rank's bank rows, and (rank 0) the queries, for ``shortcutlab score-bank``."""
        folder = Path(self.save_features)
        folder.mkdir(parents=True, exist_ok=True)
        rank, world_size = rank_and_world_size()
        about = {"epoch": int(trainer.current_epoch), "step": int(trainer.global_step), "bank_dtype": self.bank_dtype,
                 "num_classes": int(num_classes), "block_rows": int(block_rows)}
        if rank == 0:
            remove_other_shards(folder, world_size)
            save_queries(folder, queries.features, queries.blocks, queries.labels, about)
        save_shard(folder, rank, world_size, bank_total, bank.features, bank.blocks, bank.labels, about)

    def state_dict(self) -> dict[str, Any]:
        return {"last_metrics": dict(self.last_metrics), "last_epoch": self.last_epoch,
                "depth_history": [dict(row) for row in self.over_depth.depth_history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_metrics = dict(state_dict.get("last_metrics", {}))
        self.last_epoch = state_dict.get("last_epoch")
        self.over_depth.depth_history = [dict(row) for row in state_dict.get("depth_history", [])]
