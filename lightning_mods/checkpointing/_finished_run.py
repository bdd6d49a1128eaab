"""The final checkpoint of a finished pre-training, named by its folder: what fine-tuning and the
probes start from when ``model.checkpoint`` is a folder rather than a file.

A pre-training that was resumed logs to a new ``lightning_logs/version_N``, so a path written
down before (``version_0/checkpoints/last.ckpt``) can name a partly trained network. Given the
run's folder (its ``trainer.default_root_dir``, or a sweep's run folder), :func:`final_checkpoint`
takes the newest checkpoint that loads among its log folders' ``checkpoints/`` (whatever version
wrote it; the folders of evaluations inside a sweep's run are not looked into) and refuses, in
one line naming it, one whose fit had not finished: fewer epochs done than its log folder's
``config.yaml`` asks (``trainer.max_epochs``), or fewer steps (``trainer.max_steps``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from lightning_mods.checkpointing.rebuild import newest_loadable, read_torch_file

LIGHTNING_DEFAULT_MAX_EPOCHS = 1000  # Trainer's when neither max_epochs nor max_steps is set


def log_folders(folder: Path) -> list[Path]:
    """The folders under ``folder`` a fit logs to: ``folder`` itself when it holds ``checkpoints/``
    (a sweep's run), and every ``<logger>/version_N`` below it (Lightning's layout)."""
    found = [folder] if (folder / "checkpoints").is_dir() else []
    return found + sorted(p for p in folder.glob("*/version_*") if (p / "checkpoints").is_dir())


def final_checkpoint(folder: str | os.PathLike, say: Callable[[str], None] = print) -> Path:
    """The newest loadable checkpoint of the finished fit logged under ``folder`` (see the module
    docstring); a ValueError of one line when there is none or its fit did not finish."""
    folder = Path(folder)
    candidates = [path for log in log_folders(folder) for path in (log / "checkpoints").glob("*.ckpt")
                  if not path.name.startswith("hpc_ckpt")]
    newest = newest_loadable(candidates, say) if candidates else None
    if newest is None:
        raise ValueError(f"model.checkpoint: no checkpoint that loads under '{folder}' (looked in checkpoints/ "
                         "and */version_*/checkpoints/); give the pre-training's folder or a checkpoint file")
    unfinished = why_unfinished(newest, newest.parent.parent / "config.yaml")
    if unfinished:
        raise ValueError(f"model.checkpoint: the newest checkpoint under '{folder}', '{newest}', {unfinished}: its "
                         "pre-training did not finish (resume it with --ckpt_path auto, or name the file to "
                         "evaluate it as it is)")
    return newest


def chosen_checkpoint(checkpoint: Optional[str], owner: str) -> Optional[str]:
    """``model.checkpoint`` as the file an evaluation reads: a pre-training's folder becomes its
    :func:`final_checkpoint`, and the file chosen is said in one line (by the first process)."""
    if checkpoint is None:
        return None
    given = checkpoint
    if Path(checkpoint).is_dir():
        checkpoint = str(final_checkpoint(checkpoint))
    refuse_a_probe(given, checkpoint)
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == 0:
        print(f"{owner}: reading the checkpoint {checkpoint}", flush=True)
    return checkpoint


def refuse_a_probe(given: str, checkpoint: str) -> None:
    """A one-line ValueError when ``checkpoint`` (``given``'s file) was written by a linear probe:
    what it holds is a probe of another network, not a pre-training to evaluate."""
    from lightning_mods.checkpointing.rebuild import canonical_class_path, import_path

    hparams = (read_torch_file(Path(checkpoint), "model.checkpoint", mmap=True) or {}).get("hyper_parameters") or {}
    try:
        cls = import_path(canonical_class_path(hparams.get("_class_path")))
    except (ImportError, AttributeError, ValueError, TypeError):
        return
    if getattr(cls, "probes_a_network", False):  # LinearProbe's class attribute
        where = f"'{given}' holds" if given == checkpoint else f"'{given}' is the folder of"
        probed = hparams.get("checkpoint")
        raise ValueError(f"model.checkpoint: {where} a linear probe ({cls.__name__}, '{checkpoint}'), not a "
                         "pre-training; give the pre-training's folder or checkpoint"
                         + (f" (this probe read '{probed}')" if probed else ""))


def why_unfinished(checkpoint: Path, config_file: Path) -> Optional[str]:
    """Why the fit that wrote ``checkpoint`` had not finished, by its log folder's config (None:
    it had); a config that cannot be read is a reason too."""
    try:
        trainer = (yaml.safe_load(config_file.read_text()) or {}).get("trainer") or {}
    except (OSError, yaml.YAMLError):
        return f"has no readable config.yaml beside its checkpoints/ to tell whether its fit finished"
    state = read_torch_file(checkpoint, "model.checkpoint", mmap=True)
    epochs_done = epochs_trained(state)
    steps = int(state.get("global_step", 0))
    max_steps, max_epochs = trainer.get("max_steps") or -1, trainer.get("max_epochs")
    if max_epochs is None and max_steps == -1:
        max_epochs = LIGHTNING_DEFAULT_MAX_EPOCHS
    if max_steps != -1 and steps >= max_steps:
        return None
    if max_epochs is not None and max_epochs != -1 and epochs_done >= max_epochs:
        return None
    goal = f"{max_epochs} epochs" if max_epochs not in (None, -1) else f"{max_steps} steps"
    return f"was written after {epochs_done} epochs ({steps} steps) of the {goal} its config asks for"


def epochs_trained(state: dict[str, Any]) -> int:
    """The epochs whose training the checkpoint's fit loop had finished."""
    progress = ((state.get("loops") or {}).get("fit_loop") or {}).get("epoch_progress") or {}
    current = progress.get("current") or {}
    return int(current.get("processed", state.get("epoch", 0)))
