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
- ``training``: the shared optimiser recipe and classification steps.

Modules that moved keep importing from their old paths (``lightning_mods.optim``), with a
``FutureWarning`` that names the new one.
"""
from lightning_mods._moved_modules import install as _install_moved_modules

__all__ = ["backbone", "mae", "diffusion", "classifier", "linear_probe", "finetune", "spiral_classifier",
           "checkpointing", "compat", "evaluation", "generation", "pictures", "training"]

# old module path -> new one
MOVED = {
    "lightning_mods.atomic_files": "lightning_mods.checkpointing.atomic_files",
    "lightning_mods.checkpoint_io": "lightning_mods.checkpointing.checkpoint_io",
    "lightning_mods.checkpoint": "lightning_mods.checkpointing.rebuild",
    "lightning_mods.optim": "lightning_mods.training.optim",
    "lightning_mods.classification_steps": "lightning_mods.training.classification_steps",
    "lightning_mods.vp_sde": "lightning_mods.generation.vp_sde",
    "lightning_mods.diffusion_sampling": "lightning_mods.generation.sampling",
    "lightning_mods.latent_vae": "lightning_mods.generation.latent_vae",
    "lightning_mods.fid": "lightning_mods.generation.fid",
    "lightning_mods.probe_head": "lightning_mods.evaluation.probe_head",
    "lightning_mods.over_depth": "lightning_mods.evaluation.over_depth",
    "lightning_mods.metric_names": "lightning_mods.evaluation.metric_names",
    "lightning_mods.eval_mode": "lightning_mods.evaluation.eval_mode",
    "lightning_mods.patch_pca": "lightning_mods.pictures.patch_pca",
    "lightning_mods.embedding_map": "lightning_mods.pictures.embedding_map",
}
_install_moved_modules(MOVED)
