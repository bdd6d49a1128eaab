"""docs/contracts.md matches the code: every dotted path of ours it names (in backticks) is a
module, or a name in one, that imports today."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("lightning_mods", "callbacks", "datamodules", "commands", "cli")
DOTTED = re.compile(r"`((?:" + "|".join(OURS) + r")(?:\.\w+)+)")


def resolves(path: str) -> bool:
    """``path`` is a module, or an attribute chain under the longest module prefix of it."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_every_path_the_contracts_name_imports():
    named = sorted(set(DOTTED.findall((ROOT / "docs" / "contracts.md").read_text())))
    assert len(named) > 20
    assert [p for p in named if not resolves(p)] == []


def test_the_check_fails_on_a_moved_path():
    assert resolves("lightning_mods.backbone.vit.DecayedVisionTransformer")
    assert not resolves("lightning_mods.backbone.vit.NoSuchThing")
    assert not resolves("cli.ShortcutLabCLI")
