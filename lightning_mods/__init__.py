"""shortcutlab's LightningModules, the shared shortcut backbone, and their helpers by role.

The LightningModules (the class paths configs and checkpoints name):
``mae.MaskedAutoencoder``, ``diffusion.DiffusionModule``, ``classifier.ImageClassifier``,
``linear_probe.LinearProbe``, ``finetune.FineTuneClassifier`` and
``spiral_classifier.SpiralClassifier``. The sub-packages:

- ``backbone``: the decayed identity shortcut and the networks built on it;
- ``checkpointing``: checkpoint files written whole, and the network a checkpoint rebuilds;
- ``compat``: the private Lightning state the package needs, fenced in one module;
- ``evaluation``: probe heads, evaluation over depth, metric names, evaluation mode;
- ``generation``: the diffusion model's SDE, samplers, latent VAE and FID image sets;
- ``pictures``: pictures of a run;
- ``recipe``: the shared optimiser recipe and classification steps.
"""
__all__ = ["backbone", "mae", "diffusion", "classifier", "linear_probe", "finetune", "spiral_classifier",
           "checkpointing", "compat", "evaluation", "generation", "pictures", "recipe"]
