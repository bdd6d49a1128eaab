"""shortcutlab's callbacks, by role.

- ``measurement``: kNN, the online linear probe, effective rank, the patch-feature picture,
  FID/KID/IS, and the shared evaluation pass they read;
- ``training``: ResidualDroppath, EMA, ``torch.compile`` of the residual blocks;
- ``reliability``: exact resume, the divergence guard, pre-emption, lost ranks, fit records;
- ``reporting``: progress bar, model summary, run summary, prediction writer;
- ``schedule``, ``settings_key`` and ``cost``: the bases of a callback of one's own (when it runs;
  several instances in one Trainer; when it works), see ``docs/extending.md``;
- ``_utils``: internal helpers.

Classes are named by their module path in configs (``callbacks.measurement.knn.KNNEvaluator``).
The old paths that saved configs name (``callbacks.knn``) still import, with a ``FutureWarning``
that names the new path and the release that removes the old one (``_graveyard``).
"""
from callbacks import _graveyard

__all__ = ["measurement", "training", "reliability", "reporting", "schedule", "settings_key", "cost"]

_graveyard.install()
