"""The metric vocabulary: one name and one unit per quantity, in every family (MAE, classifier,
spiral, LinearProbe, diffusion) and every display (progress bar, validate table, run summary,
``summary.json``, the loggers' files).

====================================  =================================================  ==================
name                                  meaning                                            unit
====================================  =================================================  ==================
``train/loss``                        training objective (per step and epoch mean)       the objective's
``val/loss``, ``test/loss``           the same objective on the val / test split         the objective's
``train/top1``                        top-1 accuracy on the training batches (epoch)     fraction in [0, 1]
``val/top1``, ``test/top1``           top-1 accuracy of the classifier / probe head      fraction in [0, 1]
``val/top5``, ``test/top5``           top-5 accuracy (top-k, k = min(5, classes))        fraction in [0, 1]
``knn/top1``, ``knn/top5``            weighted kNN accuracy of the features (k=20)       fraction in [0, 1]
``online_probe/train_loss``           cross-entropy of the online head (epoch mean)      nats
``online_probe/train_top1``           its top-1 on the probed samples (epoch mean)       fraction in [0, 1]
``online_probe/val_top1``             its top-1 accuracy on the validation split         fraction in [0, 1]
``rank/effective_rank``               exp(H) of the normalised singular values           dimensions
``rank/entropy``                      H, the paper's "effective rank"                    nats
``feature/norm``                      mean L2 norm of a block's pooled output            norm
``val/fid``                           Frechet Inception distance of generated samples    FID (lower better)
``val/kid_mean``, ``val/isc_mean``    kernel Inception distance, Inception score         KID, IS
====================================  =================================================  ==================

The objective's unit: cross-entropy in nats for the classifier, spiral and LinearProbe; mean
squared error of (normalised) pixels for the MAE and of the noise for diffusion. ``train/loss``
is logged per step and as epoch mean, which Lightning writes to the logger files as
``train/loss_step`` and ``train/loss_epoch``. Accuracies are fractions everywhere they are
logged or shown; a Markdown report may print percentages with the unit in its header.
The per-block rank profile is a file and a picture, not metrics (``callbacks/measurement/effective_rank.py``);
so are the per-block kNN, probe and feature-norm values (``feature/norm`` is a column of
``eval_per_block.csv``, ``lightning_mods/evaluation/over_depth.py``).
"""
from __future__ import annotations

TRAIN_LOSS = "train/loss"
VAL_LOSS = "val/loss"
TEST_LOSS = "test/loss"
TRAIN_TOP1 = "train/top1"
VAL_TOP1 = "val/top1"
VAL_TOP5 = "val/top5"
TEST_TOP1 = "test/top1"
TEST_TOP5 = "test/top5"
KNN_TOP1 = "knn/top1"
KNN_TOP5 = "knn/top5"
ONLINE_PROBE_TRAIN_LOSS = "online_probe/train_loss"
ONLINE_PROBE_TRAIN_TOP1 = "online_probe/train_top1"
ONLINE_PROBE_VAL_TOP1 = "online_probe/val_top1"
EFFECTIVE_RANK = "rank/effective_rank"
RANK_ENTROPY = "rank/entropy"
FEATURE_NORM = "feature/norm"
VAL_FID = "val/fid"

LOSS = {"train": TRAIN_LOSS, "val": VAL_LOSS, "test": TEST_LOSS}
TOP1 = {"train": TRAIN_TOP1, "val": VAL_TOP1, "test": TEST_TOP1}
TOP5 = {"val": VAL_TOP5, "test": TEST_TOP5}

FRACTIONS = frozenset({TRAIN_TOP1, VAL_TOP1, VAL_TOP5, TEST_TOP1, TEST_TOP5, KNN_TOP1, KNN_TOP5,
                       ONLINE_PROBE_TRAIN_TOP1, ONLINE_PROBE_VAL_TOP1})


def knn_topk(k: int) -> str:
    """``knn/top<k>``: the kNN evaluator's top-k accuracy."""
    return f"knn/top{k}"


def generation_metric(name: str) -> str:
    """``val/<name>`` of a generation metric (``fid``, ``kid_mean``, ``isc_mean``, ...)."""
    return f"val/{name}"


# --- several settings, several instances ------------------------------------------------------
# A callback that measures at several settings (``KNNEvaluator(k=[10, 20])``) or that shares the
# trainer with another instance of its class logs ``<name>@<setting>=<value>[,...]``, e.g.
# ``knn/top1@k=10`` or ``rank/effective_rank@source=features``; one instance at one setting keeps
# the plain name, so configs, reports and dashboards of single-instance runs read as before.
_variant_separator = "@"


def variant(name: str, tag: str) -> str:
    """``name`` at the setting ``tag`` (``"k=10"``): ``knn/top1@k=10``; ``tag=""``: ``name``."""
    return f"{name}{_variant_separator}{tag}" if tag else name


def base_name(name: str) -> str:
    """The vocabulary name of a (possibly variant) metric: ``knn/top1@k=10`` -> ``knn/top1``."""
    return name.split(_variant_separator, 1)[0]


def variant_tag(name: str) -> str:
    """The setting part of a variant name (``"k=10"``), ``""`` for a plain name."""
    return name.partition(_variant_separator)[2]


def join_tags(*tags: str) -> str:
    """``join_tags("temperature=0.1", "k=10")`` -> ``temperature=0.1,k=10`` (empty parts dropped)."""
    return ",".join(tag for tag in tags if tag)


def is_fraction(name: str) -> bool:
    """Whether the (possibly variant) metric ``name`` is an accuracy, a fraction in [0, 1]."""
    return base_name(name) in FRACTIONS
