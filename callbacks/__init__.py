"""shortcutlab's callbacks: measurements of what the shortcut does, and the reliability callbacks
every shipped config lists (SPEC section 6).

Public modules (``__all__``; see ``docs/extending.md`` for writing a measurement callback of
one's own). Classes are imported from their modules (``callbacks.knn.KNNEvaluator``), the class
paths configs name; the modules not listed are internal.
"""
__all__ = [
    "knn",                  # KNNEvaluator
    "online_probe",         # OnlineLinearProbe
    "effective_rank",       # EffectiveRank
    "fid",                  # GenerationMetrics: FID, KID, IS of the diffusion model
    "patch_features",       # PatchFeaturePicture
    "residual_droppath",    # ResidualDroppath
    "schedule",             # ScheduledEvaluation: when evaluation callbacks run
    "settings_key",         # SettingsKeyed: several instances of one callback in a Trainer
    "exact_resume",         # ExactResume
    "nonfinite_guard",      # NonFiniteGuard
    "preemption",           # PreemptionCheckpoint
    "progress_bar",         # TrainingLossProgressBar: the shipped configs' bar
    "lost_rank",            # LostRankReport
    "run_summary",          # RunSummary
    "fit_end_record",       # FitEndRecord
    "fresh_monitor_checkpoint",  # FreshMonitorCheckpoint
    "prediction_writer",    # PredictionWriter
    "compile",              # CompileBlocks: torch.compile of the residual blocks
    "shared_features",      # shared_features: one feature pass per evaluation for every callback
]
