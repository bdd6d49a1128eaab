"""``config.yaml`` in the run's own folder, whatever the logger.

LightningCLI's ``SaveConfigCallback`` writes to ``trainer.log_dir``, which for any logger but
TensorBoard and CSV is the logger's ``save_dir``: every W&B run (``.``) and every MLflow run
(``./mlruns``) would write the same file. :class:`RunConfig` writes it to the run's folder
(:func:`~lightning_mods.run_outputs.run_folder.run_dir`, the folder of its ``checkpoints/``) and
sends it to the loggers that keep files (W&B, MLflow)."""
from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback

from lightning_mods.checkpointing.atomic_files import write_text_atomically
from lightning_mods.run_outputs.run_folder import run_dir
from lightning_mods.run_outputs.to_loggers import send_file


class RunConfig(SaveConfigCallback):
    """LightningCLI's config saving, into the run's folder (global rank 0 writes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["save_to_log_dir"] = False  # save_config below writes it, where the run's other files go
        super().__init__(*args, **kwargs)

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        folder = run_dir(trainer)
        text = self.parser.dump(self.config, skip_unset=False)
        path = write_text_atomically(folder / self.config_filename, text)
        send_file(trainer, path, folder)
