"""The arithmetic of a kNN bank that may be split over ranks (or over files): each part's top-k
neighbours of every query, merged into the global top-k, then the temperature-weighted vote.

- **Sharded.** A rank holds only the bank rows it embedded. :func:`local_neighbours` scores every
  query against them; :func:`merge_across_ranks` gathers the ranks' top-k (similarity, label,
  bank index) and keeps the best ``k`` of them, so every rank ends with the neighbours one process
  holding the whole bank finds. The votes, added in the same order, then equal the one-process scores.
- **The same numbers at any world size.** The ranks own whole blocks of the bank (the batches of
  the feature pass, :func:`~callbacks._utils.distributed.block_shard`), and each block is
  multiplied with the same chunks of queries whatever the world size, so every similarity is the
  same float32 number at 1 or 64 processes. Neighbours are ordered by similarity and, at equal
  similarity, by their index in the whole bank (:func:`ordered_topk`): a tie at the k-th place goes
  to the lower index wherever the two rows live, so the accuracies are equal to the last digit.
- **Memory.** Work memory is a budget in bytes, not a count of similarities: the query rows
  scored at once are as many as keep ``rows x bank rows`` float32 similarities within it, so a
  larger budget reads the bank fewer times. A bank stored in another dtype or on another device
  (host memory) is brought to the queries' device and to float32 a chunk at a time.
- Similarities are computed in float32 whatever the storage; the bank is expected L2-normalised
  (the evaluator stores it so); queries are normalised here.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from callbacks._utils.distributed import all_gather_rows, is_distributed, rank_and_world_size

DEFAULT_SCORING_BYTES = 256 * 2 ** 20  # 256 MiB of similarities and copies a scoring step


def query_rows(budget_bytes: int, bank_rows: int) -> int:
    """Query rows scored at once against ``bank_rows`` bank rows: their float32 similarities
    (and ``topk``'s working copy of a row) fit in ``budget_bytes``."""
    return max(1, int(budget_bytes) // (4 * max(1, bank_rows)))


def bank_rows_per_copy(budget_bytes: int, width: int) -> int:
    """Bank rows brought to the scoring device and dtype at once: half the budget."""
    return max(1, int(budget_bytes) // 2 // (4 * max(1, width)))


PAD_INDEX = 2 ** 53  # the index of padding: after every bank row, and exact in float64 (merge_across_ranks)
STEP_BLOCKS = 8  # blocks of the bank scored against a chunk of queries at least, when the budget allows


class Neighbours(NamedTuple):
    """The ``k`` nearest bank rows of each query, most similar first, ties to the lower bank index:
    ``sims`` (float32), ``labels`` and ``index`` (the bank row's index in the whole bank), each ``Q x k``."""

    sims: torch.Tensor
    labels: torch.Tensor
    index: torch.Tensor


def ordered_topk(sims: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (``Q x k``) of the ``k`` largest entries of each row of ``sims``, ordered by
    similarity (largest first) and, at equal similarity, by ``index`` (``N`` or ``Q x N``, the
    entries' bank indices; lower first). The order is total, so the top ``k`` of a bank is the top
    ``k`` of its parts' top ``k``, however the bank is split: ties do not depend on the split."""
    k = min(k, sims.shape[1])
    index = index.expand_as(sims)
    values, where = sims.topk(k, dim=1)
    straddling = (sims >= values[:, -1:]).sum(1) > k  # a tie at the k-th place: topk kept any of them
    if bool(straddling.any()):
        rows = straddling.nonzero().squeeze(1)
        by_index = index[rows].argsort(dim=1)
        by_value = sims[rows].gather(1, by_index).sort(dim=1, descending=True, stable=True).indices[:, :k]
        where[rows] = by_index.gather(1, by_value)
    by_index = index.gather(1, where).argsort(dim=1)
    where = where.gather(1, by_index)
    return where.gather(1, sims.gather(1, where).sort(dim=1, descending=True, stable=True).indices)


def best_of(candidates: Neighbours, k: int) -> Neighbours:
    """The best ``k`` of each row's candidates, in :func:`ordered_topk`'s order."""
    where = ordered_topk(candidates.sims, candidates.index, k)
    return Neighbours(*(t.gather(1, where) for t in candidates))


def keep_best(first: Neighbours, second: Neighbours, k: int) -> Neighbours:
    """The best ``k`` neighbours of two neighbour sets of the same queries."""
    return best_of(Neighbours(*(torch.cat([a, b], 1) for a, b in zip(first, second))), k)


def local_neighbours(bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, k: int,
                     budget_bytes: int = DEFAULT_SCORING_BYTES, bank_index: Optional[torch.Tensor] = None,
                     block_rows: Optional[int] = None) -> Neighbours:
    """The ``k`` most similar rows of ``bank`` to every row of ``queries`` (L2-normalised, on the
    scoring device), as :class:`Neighbours`. Where the bank has fewer than ``k`` rows the rest is
    padding: similarity ``-inf``, label 0, index :data:`PAD_INDEX`.

    ``bank_index``: each bank row's index in the whole bank (default: its row here); ties go to the
    lower index. ``block_rows``: the bank is a sequence of blocks of that many rows (the last may be
    shorter) that the ranks own whole; each block is multiplied with a chunk of queries on its own, so
    every similarity comes from the same product whatever else this rank holds. Without it the
    bank (or each part brought to the scoring device) is one product."""
    device, width, total = queries.device, queries.shape[1], len(bank)
    found = Neighbours(torch.full((len(queries), k), float("-inf"), device=device),
                       torch.zeros((len(queries), k), dtype=torch.int64, device=device),
                       torch.full((len(queries), k), PAD_INDEX, dtype=torch.int64, device=device))
    if total == 0 or len(queries) == 0:
        return found
    index = (torch.arange(total, device=device) if bank_index is None
             else bank_index.to(device=device, dtype=torch.int64))
    block = block_rows or total
    usable = bank.dtype == torch.float32 and bank.device == device
    copy_rows = total if usable else max(1, bank_rows_per_copy(budget_bytes, width) // block) * block
    sims_budget = budget_bytes if usable else max(1, budget_bytes - copy_rows * width * 4)
    # queries a step: from the budget and the block size alone, so a block meets the same query
    # chunks at any world size
    rows = query_rows(sims_budget, block * (STEP_BLOCKS if block_rows else 1))
    blocks_a_step = max(1, sims_budget // (4 * rows * block))
    for start in range(0, total, copy_rows):
        part = bank[start:start + copy_rows].to(device=device, dtype=torch.float32, non_blocking=True)
        part_labels = bank_labels[start:start + copy_rows].to(device=device, dtype=torch.int64)
        part_index = index[start:start + copy_rows]
        step = blocks_a_step * block
        for first in range(0, len(part), step):
            last = min(first + step, len(part))
            for q in range(0, len(queries), rows):
                chunk = queries[q:q + rows]
                sims = torch.empty((len(chunk), last - first), device=device)
                for b in range(first, last, block):  # one product a block
                    sims[:, b - first:min(b + block, last) - first] = chunk @ part[b:min(b + block, last)].T
                where = ordered_topk(sims, part_index[first:last], k)
                new = Neighbours(sims.gather(1, where), part_labels[first:last][where], part_index[first:last][where])
                if new.sims.shape[1] < k or start > 0 or first > 0:  # keep the best k of both
                    new = keep_best(Neighbours(*(t[q:q + rows] for t in found)), new, k)
                for into, value in zip(found, new):
                    into[q:q + rows] = value
    return found


def merge_across_ranks(found: Neighbours, budget_bytes: int = DEFAULT_SCORING_BYTES) -> Neighbours:
    """Every rank's :func:`local_neighbours` of the same queries merged into the global top-k, the
    same on every rank (one process: as given). Gathered a block of queries at a time, as many as
    keep the gathered ``W x rows x k`` (similarity, label, index) triples within the budget."""
    if not is_distributed():
        return found
    _, world_size = rank_and_world_size()
    k = found.sims.shape[1]
    rows = max(1, int(budget_bytes) // (24 * world_size * max(1, k)))
    merged = Neighbours(*(torch.empty_like(t) for t in found))
    for q in range(0, len(found.sims), rows):
        # float64 holds a float32 similarity and integers below 2**53 exactly: one collective
        packed = torch.cat([t[q:q + rows].double() for t in found], 1)
        every = all_gather_rows(packed).view(world_size, -1, 3 * k).transpose(0, 1)  # rows x W x 3k
        candidates = Neighbours(every[..., :k].reshape(len(packed), -1).float(),
                                every[..., k:2 * k].reshape(len(packed), -1).long(),
                                every[..., 2 * k:].reshape(len(packed), -1).long())
        for into, value in zip(merged, best_of(candidates, k)):
            into[q:q + rows] = value
    return merged


def vote(sims: torch.Tensor, labels: torch.Tensor, num_classes: int, k: int, temperature: float) -> torch.Tensor:
    """Class scores ``Q x C``: the first ``k`` neighbours vote with weights ``exp(s / T)``, added
    in sorted order (padding never votes)."""
    sims, labels = sims[:, :k], labels[:, :k]
    weights = (sims / temperature).exp()  # padding, at -inf, weighs exp(-inf) = 0
    scores = torch.zeros(len(sims), num_classes, device=sims.device)
    return scores.scatter_add_(1, labels, weights)


def normalized_queries(queries: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The queries L2-normalised in float32 on the scoring device (a copy of the queries, never of the bank)."""
    return F.normalize(queries.to(device=device, dtype=torch.float32), dim=1)


def neighbour_count(ks: Sequence[int], bank_rows: int) -> int:
    """The top-k taken once for every ``k`` of ``ks``: the largest, at most the bank's rows."""
    return max(1, min(max(ks), bank_rows))


def rank_classes(scores: torch.Tensor) -> torch.Tensor:
    """Classes by decreasing score, ties to the lower class index: ``Q x C`` indices."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices


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


def correct_counts(sims: torch.Tensor, labels: torch.Tensor, query_labels: torch.Tensor, num_classes: int,
                   ks: Sequence[int], temperature: float, tops: tuple[int, ...],
                   budget_bytes: int = DEFAULT_SCORING_BYTES) -> torch.Tensor:
    """Correct counts (int64, one per ``k`` of ``ks`` and ``top`` of ``tops``, in that order) of
    the neighbours' votes, a block of queries at a time (no ``Q x C`` matrix per ``k``)."""
    rows = max(1, int(budget_bytes) // (16 * max(1, num_classes)))
    counts = torch.zeros(len(ks) * len(tops), dtype=torch.int64, device=sims.device)
    for q in range(0, len(sims), rows):
        part = slice(q, q + rows)
        counts += torch.cat([topk_correct(vote(sims[part], labels[part], num_classes, k, temperature),
                                          query_labels[part], tops) for k in ks])
    return counts


def all_finite(tensor: torch.Tensor, rows: int = 1024) -> bool:
    """Whether every entry is finite, read ``rows`` rows at a time: ``isfinite`` makes several
    temporaries the size of its input, which must stay small beside a bank."""
    return all(bool(torch.isfinite(tensor[i:i + rows]).all()) for i in range(0, len(tensor), rows))
