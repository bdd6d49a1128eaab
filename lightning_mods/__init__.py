"""shortcutlab's LightningModules, the shared shortcut backbone, and their helpers by role.

The LightningModules (the class paths configs and checkpoints name):
``mae.MaskedAutoencoder``, ``diffusion.DiffusionModule``, ``classifier.ImageClassifier``,
``linear_probe.LinearProbe``, ``finetune.FineTuneClassifier`` and
``spiral_classifier.SpiralClassifier``. The sub-packages:

- ``backbone``: the decayed identity shortcut and the networks built on it;
- ``checkpointing``: checkpoint files written whole, and the network a checkpoint rebuilds;
- ``evaluation``: probe heads, evaluation over depth, metric names, evaluation mode;
- ``pictures``: pictures of a run;
- ``recipe``: the shared optimiser recipe.

Modules and packages whose names start with ``_`` are the package's own machinery (the diffusion
model's SDE and samplers in ``_generation``, the private Lightning state in ``_compat``, ...): no
config names them and they may change without notice.
"""
__all__ = ["backbone", "mae", "diffusion", "classifier", "linear_probe", "finetune", "spiral_classifier",
           "checkpointing", "evaluation", "pictures", "recipe"]
