"""The checkpoint a ``shortcutlab`` command is given (``--ckpt_path``): which file it names, that it
rebuilds exactly the network the config asks for, and the log folder a resumed fit goes on in.

- **Which file.** ``auto`` and a restarted SLURM job resolve to the newest checkpoint that loads; a
  run's folder to its final (or newest) checkpoint; Lightning's aliases and URLs are refused. The
  file is read once, ``weights_only``, before anything is built.
- **The network that wrote it.** The checkpoint's class and settings must be the config's (one
  line naming both values otherwise); the model is rebuilt from the checkpoint's own settings, and
  once built its weights' shapes must fit (values linked from the data).
- **One run, one log.** A fit resumed from a checkpoint logs on in the folder the checkpoint was
  written in: one curve in TensorBoard, one ``metrics.csv`` (a new ``version_<n+1>`` split the run
  in two). Only a logger given no version of its own is continued, and only when the checkpoint
  lies in one of its ``version_<n>`` folders. Lightning's CSVLogger deletes an existing
  ``metrics.csv`` when it starts: the file is kept aside as ``metrics.before_resume.csv`` first,
  and its rows from before the checkpoint are put back in front of the resumed rows when the fit
  ends (a fit that fails leaves the file aside; the next resume merges it in).
"""
from __future__ import annotations

import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from commands._run_folder import merge_metrics_csv
from commands.cli_output import BadInput
from commands.cli_settings import DATA_NAMES, LINKED_FROM_DATA
from lightning_mods._compat import lightning_private
from lightning_mods.checkpointing import migration
from lightning_mods.checkpointing._finished_run import final_checkpoint
from lightning_mods.checkpointing.rebuild import (canonical_class_path, checkpoint_model_config, conflict_message,
                                                  flat_settings, import_path, newest_loadable, read_torch_file,
                                                  setting_conflicts, state_dict_mismatch)


# --- which file ------------------------------------------------------------------------------
LIGHTNING_CKPT_ALIASES = ("best", "last", "hpc", "registry")


AUTO_CKPT_PATH = "auto"


def say(line: str) -> None:
    """One line on stderr, from the job's first process only (not once per process)."""
    if int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("LOCAL_RANK", 0)))) == 0:
        print(f"shortcutlab: {line}", file=sys.stderr)


def newest_resume_point(root: Path) -> Optional[Path]:
    """The newest checkpoint under ``root`` that loads (Lightning's mid-step ``hpc_ckpt_*`` files
    left out); None when there is none."""
    files = [p for p in root.rglob("*.ckpt") if not p.name.startswith("hpc_ckpt")] if root.is_dir() else []
    return newest_loadable(files, say)


def resolve_auto_ckpt_path(cfg) -> None:  # noqa: ANN001 (the fit subcommand's jsonargparse Namespace)
    """``--ckpt_path auto``, and a restarted SLURM job (``SLURM_RESTART_COUNT > 0``) without
    ``--ckpt_path``: resume from the newest checkpoint under ``trainer.default_root_dir`` that
    loads (:func:`newest_resume_point`), said in one line; none: a fresh start, said too.
    ``cfg.ckpt_path`` is set in place."""
    restarted = int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0
    if cfg.get("ckpt_path") != AUTO_CKPT_PATH and not (restarted and cfg.get("ckpt_path") is None):
        return
    root = Path((cfg.get("trainer") or {}).get("default_root_dir") or os.getcwd())
    why = "--ckpt_path auto" if cfg.get("ckpt_path") == AUTO_CKPT_PATH else \
        f"SLURM restart {os.environ['SLURM_RESTART_COUNT']} of job {os.environ.get('SLURM_JOB_ID', '?')}"
    found = newest_resume_point(root)
    cfg["ckpt_path"] = str(found) if found is not None else None
    if found is None:
        say(f"{why}: no checkpoint under {root}; starting fresh")
        return
    step = read_torch_file(found, "ckpt_path", mmap=True).get("global_step", "?")
    say(f"{why}: resuming from {found} (step {step})")


def resolve_folder_ckpt_path(cfg, subcommand: str) -> None:  # noqa: ANN001 (a subcommand's jsonargparse Namespace)
    """``--ckpt_path`` naming a run's folder, as ``model.checkpoint`` may: ``validate``, ``test`` and
    ``predict`` read the final checkpoint of the finished fit logged there, ``fit`` resumes from the
    newest checkpoint under it that loads; the file chosen is said in one line and set in place."""
    given = cfg.get("ckpt_path")
    if not given or not Path(given).is_dir():
        return
    if subcommand == "fit":
        found = newest_resume_point(Path(given))
        if found is None:
            raise BadInput(f"ckpt_path: no checkpoint that loads under the folder '{given}'")
    else:
        try:
            found = final_checkpoint(given, say=say)
        except ValueError as err:
            raise BadInput(str(err).replace("model.checkpoint:", "ckpt_path:", 1)) from None
    say(f"--ckpt_path {given}: {found}")
    cfg["ckpt_path"] = str(found)


def check_ckpt_path(ckpt_path: Optional[str]) -> Optional[dict]:
    """The checkpoint at ``ckpt_path``, or a one-line error unless it is a Lightning checkpoint
    ``torch.load`` reads with ``weights_only`` (a pickle that would run code is refused unread).

    Lightning's aliases (``last``, ``best``, ``hpc``, ``registry``) and URLs are refused: they
    name a file only once the trainer runs, after the checks that the checkpoint's class and
    settings are the model's, so a config with other settings would silently train or
    evaluate the checkpoint's weights under its own settings.
    """
    if not ckpt_path:
        return None
    if str(ckpt_path).split(":")[0] in LIGHTNING_CKPT_ALIASES:
        raise BadInput(f"ckpt_path: give the checkpoint's file path (e.g. <run>/checkpoints/last.ckpt), not "
                       f"Lightning's alias '{ckpt_path}', whose file is not known when the checkpoint is checked "
                       "against the config")
    if "://" in str(ckpt_path):
        raise BadInput(f"ckpt_path: a local file is needed, got the URL '{ckpt_path}'; copy the checkpoint here "
                       "first (it is checked against the config before anything runs)")
    try:
        ckpt = read_torch_file(ckpt_path, "ckpt_path", mmap=True)
    except (FileNotFoundError, ValueError) as err:
        raise BadInput(str(err)) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise BadInput(f"ckpt_path: '{ckpt_path}' is a torch file but not a Lightning checkpoint (no 'state_dict')")
    migration.upgrade(ckpt)  # an earlier release's layout, as the trainer will read it
    return ckpt


# --- the network that wrote it -------------------------------------------------------------------
def model_of_checkpoint(parser: Any, config: Any, subcommand: str, ckpt: dict, ckpt_path: str) -> tuple[Any, dict]:
    """``config`` with the model rebuilt from the checkpoint's own class and settings (a value the
    config sets for an inference setting, such as a sampler, wins), and the checkpoint's tensors
    for :func:`check_weights_fit`; a class or setting of the config that disagrees with the
    checkpoint is a one-line ValueError naming both values (nothing is built, nothing trains).
    A checkpoint written outside the CLI (``Trainer.fit`` in Python) names no class: the config's
    is taken, and its settings and weights must still agree."""
    given = yaml.safe_load(parser.dump(config, skip_link_targets=False, skip_unset=False))
    given = (given.get(subcommand) or {}).get("model") or {}
    written = checkpoint_model_config(ckpt, ckpt_path, class_path=given.get("class_path"))
    if canonical_class_path(given.get("class_path")) != canonical_class_path(written["class_path"]):
        raise ValueError(f"--ckpt_path: {ckpt_path!r} is a checkpoint of {written['class_path']}, the model is "
                         f"{given.get('class_path')}; give the config the checkpoint was trained with")
    cls = import_path(canonical_class_path(written["class_path"]))
    free = set(getattr(cls, "inference_settings", ()))  # not weights: the config's value wins
    settings = {k: v for k, v in flat_settings(given).items()  # the data's values: checked once it is built
                if k.removeprefix("network.").split(".")[0] not in (*LINKED_FROM_DATA, *DATA_NAMES)
                and k.split(".")[0] not in free}
    conflicts = setting_conflicts(settings, flat_settings(written))
    if conflicts:
        raise ValueError(conflict_message(conflicts, "--ckpt_path: model.", ckpt_path, "in the config")
                         + "; the checkpoint's network is rebuilt from its own settings: drop or match them")
    given_init = {**(given.get("init_args") or {}), **(given.get("dict_kwargs") or {})}
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
    init = {**written["init_args"], **{k: given_init[k] for k in free
                                       if k in given_init and given_init[k] != defaults.get(k)}}
    try:
        config = parser.parse_object({subcommand: {"model": {"class_path": written["class_path"],
                                                             "dict_kwargs": init}}}, config)
    except SystemExit:
        sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
        raise
    return config, {k: v for k, v in ckpt["state_dict"].items() if isinstance(v, torch.Tensor)}


def check_weights_fit(model: torch.nn.Module, ckpt_path: str, state: dict) -> None:
    """The built model takes the checkpoint's weights (the data's image size, channels and classes,
    linked in, can still give other shapes), else one line."""
    mismatch = state_dict_mismatch(model, state)
    if mismatch is not None:
        raise ValueError(f"--ckpt_path: {ckpt_path!r} does not fit the model: {mismatch}; give the config "
                         "(data included) the checkpoint was trained with")


# --- one run, one log ----------------------------------------------------------------------------
ASIDE = "metrics.before_resume.csv"


def checkpoint_version(logger: Any, ckpt_path: str) -> Optional[int]:
    """``n`` when ``ckpt_path`` lies in the logger's ``version_<n>`` folder, else None."""
    try:
        relative = Path(ckpt_path).resolve().relative_to(Path(logger.root_dir).resolve())
    except ValueError:
        return None
    match = re.fullmatch(r"version_(\d+)", relative.parts[0]) if len(relative.parts) > 1 else None
    return int(match.group(1)) if match else None


def continue_logger_versions(trainer: Any, ckpt_path: Optional[str]) -> list[Path]:
    """Point the trainer's unversioned TensorBoard and CSV loggers at the checkpoint's version;
    returns the CSV folders whose ``metrics.csv`` was kept aside (for :func:`merge_kept_metrics`):
    theirs, and that of a CSV logger given its folder (a sweep's run) when the checkpoint lies in it."""
    kept = []
    if not ckpt_path:
        return kept
    for logger in trainer.loggers:
        if not isinstance(logger, (TensorBoardLogger, CSVLogger)):
            continue
        if lightning_private.logger_version_given(logger):
            folder = Path(logger.log_dir)
            if isinstance(logger, CSVLogger) and trainer.is_global_zero and folder.resolve() in Path(
                    ckpt_path).resolve().parents:
                keep_metrics_aside(folder)
                kept.append(folder)
            continue
        version = checkpoint_version(logger, ckpt_path)
        if version is None:
            continue
        lightning_private.set_logger_version(logger, version)
        if isinstance(logger, CSVLogger) and trainer.is_global_zero:
            folder = Path(logger.root_dir) / f"version_{version}"
            keep_metrics_aside(folder)
            kept.append(folder)
    return kept


def keep_metrics_aside(folder: Path) -> None:
    """Move ``metrics.csv`` to :data:`ASIDE` (merging in what an earlier failed resume left there)."""
    metrics, aside = folder / "metrics.csv", folder / ASIDE
    if not metrics.is_file():
        return
    if aside.is_file():
        merge_metrics_csv(aside.read_text(), metrics)
    os.replace(metrics, aside)


def merge_kept_metrics(folders: list[Path]) -> None:
    """Put the kept rows back in front of the resumed fit's ``metrics.csv``."""
    for folder in folders:
        aside = folder / ASIDE
        if aside.is_file():
            merge_metrics_csv(aside.read_text(), folder / "metrics.csv")
            aside.unlink()
