"""Which checkpoint ``--ckpt_path`` names: ``auto`` and a restarted SLURM job resolve to the
newest checkpoint that loads; Lightning's aliases and URLs are refused, and the file is read
once, ``weights_only``, before anything is built."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from commands.cli_errors import BadInput
from lightning_mods.checkpointing import migration
from lightning_mods.checkpointing._finished_run import final_checkpoint
from lightning_mods.checkpointing.rebuild import newest_loadable, read_torch_file


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
