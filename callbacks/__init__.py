"""shortcutlab's callbacks, by role.

- ``measurement``: kNN, the online linear probe, effective rank, the patch-feature picture,
  FID/KID/IS, and the shared evaluation pass they read;
- ``training``: ResidualDroppath, EMA, ``torch.compile`` of the residual blocks;
- ``reliability``: exact resume, the divergence guard, pre-emption, lost ranks, fit records;
- ``reporting``: progress bar, model summary, run summary, prediction writer;
- ``schedule`` and ``settings_key``: the bases of a callback of one's own (when it runs; several
  instances in one Trainer), see ``docs/extending.md``;
- ``_utils``: internal helpers.

Classes are named by their module path in configs (``callbacks.measurement.knn.KNNEvaluator``).
Modules that moved keep importing from their old paths (``callbacks.knn``), with a
``FutureWarning`` that names the new one.
"""
from lightning_mods._moved_modules import install as _install_moved_modules

__all__ = ["measurement", "training", "reliability", "reporting", "schedule", "settings_key"]

# old module path -> new one
MOVED = {
    "callbacks.knn": "callbacks.measurement.knn",
    "callbacks.online_probe": "callbacks.measurement.online_probe",
    "callbacks.effective_rank": "callbacks.measurement.effective_rank",
    "callbacks.fid": "callbacks.measurement.fid",
    "callbacks.patch_features": "callbacks.measurement.patch_features",
    "callbacks.shared_features": "callbacks.measurement.shared_features",
    "callbacks.residual_droppath": "callbacks.training.residual_droppath",
    "callbacks.ema": "callbacks.training.ema",
    "callbacks.compile": "callbacks.training.compile",
    "callbacks.exact_resume": "callbacks.reliability.exact_resume",
    "callbacks.nonfinite_guard": "callbacks.reliability.nonfinite_guard",
    "callbacks.preemption": "callbacks.reliability.preemption",
    "callbacks.lost_rank": "callbacks.reliability.lost_rank",
    "callbacks.bad_input_cleanup": "callbacks.reliability.bad_input_cleanup",
    "callbacks.fresh_monitor_checkpoint": "callbacks.reliability.fresh_monitor_checkpoint",
    "callbacks.fit_end_record": "callbacks.reliability.fit_end_record",
    "callbacks.progress_bar": "callbacks.reporting.progress_bar",
    "callbacks.model_summary": "callbacks.reporting.model_summary",
    "callbacks.run_summary": "callbacks.reporting.run_summary",
    "callbacks.prediction_writer": "callbacks.reporting.prediction_writer",
    "callbacks.distributed": "callbacks._utils.distributed",
    "callbacks.feature_collection": "callbacks._utils.feature_collection",
    "callbacks.feature_replay": "callbacks.measurement.online_probe.feature_replay",
}
_install_moved_modules(MOVED)
