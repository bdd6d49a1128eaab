"""The arithmetic of a kNN bank that may be split over ranks (or over files): each part's top-k
neighbours of every query, merged into the global top-k, then the temperature-weighted vote.

- **Sharded.** A rank holds only the bank rows it embedded. :func:`local_neighbours` scores every
  query against them; :func:`merge_across_ranks` gathers the ranks' top-k (similarity, label)
  and keeps the best ``k`` of them, so every rank ends with the neighbours one process holding
  the whole bank would find (ties at the k-th similarity aside: ``torch.topk`` keeps either).
  The votes, added in the same sorted order, then equal the one-process scores.
- **Memory.** Work memory is a budget in bytes, not a count of similarities: the query rows
  scored at once are as many as keep ``rows x bank rows`` float32 similarities within it, so a
  larger budget reads the bank fewer times. A bank stored in another dtype or on another device
  (host memory) is brought to the queries' device and to float32 a chunk at a time.
- Similarities are computed in float32 whatever the storage; the bank is expected L2-normalised
  (the evaluator stores it so); queries are normalised here.
"""
from __future__ import annotations

from typing import Sequence

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


def merge_topk(sims: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of ``sims`` (sorted, largest first) and their ``labels``."""
    best, where = sims.topk(min(k, sims.shape[1]), dim=1)
    return best, labels.gather(1, where)


def keep_best(first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor],
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``k`` neighbours of two ``(similarities, labels)`` sets of the same queries."""
    return merge_topk(torch.cat([first[0], second[0]], 1), torch.cat([first[1], second[1]], 1), k)


def local_neighbours(bank: torch.Tensor, bank_labels: torch.Tensor, queries: torch.Tensor, k: int,
                     budget_bytes: int = DEFAULT_SCORING_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """``(similarities, labels)``, each ``Q x k``: the ``k`` most similar rows of ``bank`` to every
    row of ``queries`` (L2-normalised, on the scoring device), most similar first. Where the bank
    has fewer than ``k`` rows the rest is padding: similarity ``-inf``, label 0."""
    device, width = queries.device, queries.shape[1]
    top_sims = torch.full((len(queries), k), float("-inf"), device=device)
    top_labels = torch.zeros((len(queries), k), dtype=torch.int64, device=device)
    if len(bank) == 0 or len(queries) == 0:
        return top_sims, top_labels
    usable = bank.dtype == torch.float32 and bank.device == device
    copy_rows = len(bank) if usable else min(len(bank), bank_rows_per_copy(budget_bytes, width))
    sims_budget = budget_bytes if usable else budget_bytes - copy_rows * width * 4
    for start in range(0, len(bank), copy_rows):
        part = bank[start:start + copy_rows].to(device=device, dtype=torch.float32, non_blocking=True)
        part_labels = bank_labels[start:start + copy_rows].to(device=device, dtype=torch.int64)
        take, rows = min(k, len(part)), query_rows(sims_budget, len(part))
        for q in range(0, len(queries), rows):
            sims, where = (queries[q:q + rows] @ part.T).topk(take, dim=1)  # sorted, most similar first
            if start == 0:
                top_sims[q:q + rows, :take], top_labels[q:q + rows, :take] = sims, part_labels[where]
            else:  # a later chunk of a bank read in parts: keep the best k of both
                top_sims[q:q + rows], top_labels[q:q + rows] = keep_best(
                    (top_sims[q:q + rows], top_labels[q:q + rows]), (sims, part_labels[where]), k)
    return top_sims, top_labels


def merge_across_ranks(sims: torch.Tensor, labels: torch.Tensor,
                       budget_bytes: int = DEFAULT_SCORING_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's :func:`local_neighbours` of the same queries merged into the global top-k,
    the same on every rank (one process: as given). Gathered a block of queries at a time, as
    many as keep the gathered ``W x rows x k`` (similarity, label) pairs within the budget."""
    if not is_distributed():
        return sims, labels
    _, world_size = rank_and_world_size()
    k = sims.shape[1]
    rows = max(1, int(budget_bytes) // (16 * world_size * max(1, k)))
    merged_sims, merged_labels = torch.empty_like(sims), torch.empty_like(labels)
    for q in range(0, len(sims), rows):
        # float64 holds a float32 similarity and an int64 label below 2**53 exactly: one collective
        packed = torch.cat([sims[q:q + rows].double(), labels[q:q + rows].double()], 1)
        every = all_gather_rows(packed).view(world_size, -1, 2 * k).transpose(0, 1)  # rows x W x 2k
        best, chosen = merge_topk(every[..., :k].reshape(len(packed), -1).float(),
                                  every[..., k:].reshape(len(packed), -1).long(), k)
        merged_sims[q:q + rows], merged_labels[q:q + rows] = best, chosen
    return merged_sims, merged_labels


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
