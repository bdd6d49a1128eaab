"""shortcutlab's LightningModules and what they share (SPEC sections 2-5).

Public modules (``__all__``; their classes and the extension points their docstrings list are
kept stable, see ``docs/extending.md``). The classes are imported from their modules
(``lightning_mods.mae.MaskedAutoencoder``), the class paths configs and checkpoints name; the
others (``atomic_files``, ``checkpoint_io``, ``eval_mode``, ``probe_head``, ...) are internal.
"""
__all__ = [
    "backbone",             # the shared shortcut backbone: schedules, residual blocks, networks
    "mae",                  # MaskedAutoencoder
    "diffusion",            # DiffusionModule (U-ViT, noise prediction)
    "classifier",           # ImageClassifier over any timm-style backbone
    "linear_probe",         # LinearProbe of a checkpoint's frozen backbone
    "spiral_classifier",    # the ResidualDroppath paper's spiral study
    "checkpoint",           # rebuild the network a checkpoint was written by
    "metric_names",         # the metric vocabulary
    "optim",                # the shared optimiser recipe
    "pictures",             # pictures of a run
]
