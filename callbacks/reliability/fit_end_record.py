"""``fit_end.json`` in the run's log folder, written only when ``fit`` returns normally.

A sweep's run folder fills while the run trains, so metrics alone cannot tell a finished run
from one that is still training, was killed, or crashed where nothing recorded its exit (a
cluster array job from ``shortcutlab sweep --print``). ``shortcutlab report`` counts a run, and
its offline probe, only when the sweep recorded exit status 0 or this file exists. The sweep adds
the callback to every fit it runs or prints (``commands._run_folder.write_logging_fragment``).

Lightning calls ``on_fit_end`` only after the fit loop ends by itself (its epochs or steps are
done, or a callback such as EarlyStopping stopped it); an exception, a divergence
(``callbacks.reliability.nonfinite_guard``) or a pre-emption signal (``callbacks.reliability.preemption``) skips it.
"""
from __future__ import annotations

import json

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_mods.checkpointing.atomic_files import write_text_atomically
from lightning_mods.run_outputs.run_folder import run_dir
from callbacks.cost import ONCE

FIT_END_FILE = "fit_end.json"


class FitEndRecord(Callback):
    """Write ``{"epochs", "steps", "max_epochs", "max_steps"}`` to ``<log dir>/fit_end.json``
    when ``fit`` ends normally (global rank 0)."""
    cost = ONCE

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a resumed or repeated fit into the same folder is not finished until it ends again;
        # not earlier than here: a fit refused while it sets up (e.g. a resume in another data
        # order) trains nothing and leaves the finished run as it was
        if trainer.is_global_zero:
            (run_dir(trainer) / FIT_END_FILE).unlink(missing_ok=True)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        record = {"epochs": int(trainer.current_epoch), "steps": int(trainer.global_step),
                  "max_epochs": trainer.max_epochs, "max_steps": trainer.max_steps}
        path = run_dir(trainer) / FIT_END_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(record, indent=2) + "\n")
