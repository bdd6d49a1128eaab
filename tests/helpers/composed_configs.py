"""The shipped configs as the tests run them: every row of configs/compositions.yaml (the
``--config`` files and values of its command) and the single-file quick configs."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from commands import lightning_cli as cli

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
REPO = CONFIG_DIR.parent
ROWS = yaml.safe_load((CONFIG_DIR / "compositions.yaml").read_text())
SINGLE_FILES = sorted(p.name for p in CONFIG_DIR.glob("*.yaml") if p.name != "compositions.yaml")


def command_args(name: str) -> list[str]:
    """The ``fit`` arguments of a row of compositions.yaml, or of a single-file config."""
    if name in ROWS:
        row = ROWS[name]
        return [f"--config={CONFIG_DIR / c}" for c in row["configs"]] + list(row.get("args", []))
    return [f"--config={CONFIG_DIR / name}"]


def resolved_config(args: list[str]) -> dict:
    """The full config ``fit`` would run with ``args`` (LightningCLI's ``--print_config``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main(["fit", *args, "--print_config"])
    return yaml.safe_load(out.getvalue())


# a narrow copy of a paper network, where a row checks that the config composes, trains and
# evaluates, not what the network's real size costs (those rows: the full_size marker)
NARROW = {"MaskedAutoencoder": {"network": dict(embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=16,
                                               decoder_depth=2, decoder_num_heads=2)},
          "DiffusionModule": {"network": dict(embed_dim=32, depth=3, num_heads=2), "init_args": dict(feature_block=1)}}


def narrow_settings(model_class_name: str) -> dict[str, dict]:
    """``{"network": ..., "init_args": ...}``: what makes a paper network narrow, its network's and its own."""
    return {"network": {}, "init_args": {}, **NARROW.get(model_class_name, {})}


def sizes(names: list[str]) -> list:
    """Each row as a narrow copy, and again at its real size under the ``full_size`` marker."""
    return [pytest.param(n, False, id=n) for n in names] + \
        [pytest.param(n, True, id=f"{n}-full_size", marks=pytest.mark.full_size) for n in names]


def narrow_args(model_class_path: str, full_size: bool) -> list[str]:
    """``--model.init_args.*`` overrides that make a paper network narrow (none at full size)."""
    if full_size:
        return []
    settings = narrow_settings(model_class_path.rpartition(".")[2])
    return [f"--model.{where}.{k}={v}" for where in ("network", "init_args") for k, v in settings[where].items()]


SWEPT = ("alpha_min=", "seed_everything=", "default_root_dir=")  # the values a paper table sweeps


def _settings(name: str) -> frozenset[str]:
    """What a row composes: its ``--config`` files and the values it sets, less the swept ones."""
    row = ROWS[name]
    return frozenset([*row["configs"], *(a for a in row.get("args", []) if not any(s in a for s in SWEPT))])


def _meetings(settings: frozenset[str], optional: list[str]) -> set[tuple]:
    """What a row runs of a table's optional settings: each one and each two of them, with
    whether the row has it (and ``()``, which every row runs: a table is never left out)."""
    have = [(o, o in settings) for o in optional]
    return {(), *((a,) for a in have), *((a, b) for i, a in enumerate(have) for b in have[i + 1:])}


def representatives(names: list[str]) -> list[str]:
    """The rows of ``names`` whose one-step fits run every pairing the others compose.

    Rows that differ only in the values a table sweeps (``alpha_min``, the seed, the run folder)
    run the same code with another number: the first stands for the group. The rows of a table
    that crosses fragments (data x network x method: the ResidualDroppath table) are chosen so
    that each two of its optional settings (a ``--config`` file or a value not every row has)
    meet, present or absent, in at least one chosen row; the others' commands are parsed by
    test_configs.py."""
    chosen = [name for name in names if name not in ROWS]
    tables: dict[str, dict[frozenset[str], str]] = {}
    for name in names:
        if name in ROWS:
            tables.setdefault(ROWS[name].get("table"), {}).setdefault(_settings(name), name)
    for groups in tables.values():
        optional = sorted(frozenset.union(*groups) - frozenset.intersection(*groups))
        runs = {name: _meetings(settings, optional) for settings, name in groups.items()}
        uncovered = set().union(*runs.values())
        while uncovered:  # greedy: the row meeting the most not yet met, the first of equals
            best = max(runs, key=lambda n: len(runs[n] & uncovered))
            chosen.append(best)
            uncovered -= runs[best]
    order = {name: i for i, name in enumerate(names)}
    return sorted(chosen, key=order.__getitem__)


def is_diffusion(name: str) -> bool:
    """Whether the run trains a DiffusionModule (read from its files' text, without parsing)."""
    files = ROWS[name]["configs"] if name in ROWS else [name]
    return any("lightning_mods.diffusion.DiffusionModule" in (CONFIG_DIR / f).read_text() for f in files)


def declared_callbacks(name: str) -> list[dict]:
    """The ``trainer.callbacks`` a run's files declare, as LightningCLI reads them: the CLI's
    defaults, replaced by a file's ``callbacks`` list, with what files append with ``callbacks+``."""
    from commands.cli_settings import DEFAULT_CALLBACKS

    callbacks: list[dict] = [dict(c) for c in DEFAULT_CALLBACKS]
    for f in ROWS[name]["configs"] if name in ROWS else [name]:
        trainer = (yaml.safe_load((CONFIG_DIR / f).read_text()) or {}).get("trainer") or {}
        callbacks = list(trainer.get("callbacks", callbacks)) + list(trainer.get("callbacks+", []))
    return callbacks


def declared_section(name: str, key: str) -> dict:
    """A run's ``data`` or ``model`` section as its files write it, merged left to right (a
    quick look without LightningCLI's parse: class path and the values the files set)."""
    def merge(into: dict, new: dict) -> dict:
        for k, v in new.items():
            into[k] = merge(dict(into.get(k) or {}), v) if isinstance(v, dict) else v
        return into

    merged: dict = {}
    for f in ROWS[name]["configs"] if name in ROWS else [name]:
        merge(merged, (yaml.safe_load((CONFIG_DIR / f).read_text()) or {}).get(key) or {})
    merged.setdefault("init_args", {})
    return merged
