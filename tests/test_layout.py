"""The import arrows of the layout (issue 11, README.md "Layout") run one way:
``cli`` -> ``commands`` -> ``callbacks`` / ``datamodules`` -> ``lightning_mods`` -> ``lightning_mods.backbone``.

Read from the source with ``ast`` (imports inside functions included), so a lazy import that
points the wrong way fails too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# layer -> the layers it may import (besides itself and third-party packages)
ALLOWED = {
    "lightning_mods.backbone": set(),
    "lightning_mods": {"lightning_mods.backbone"},
    "datamodules": {"lightning_mods", "lightning_mods.backbone"},
    "callbacks": {"lightning_mods", "lightning_mods.backbone", "datamodules"},
    "commands": {"callbacks", "datamodules", "lightning_mods", "lightning_mods.backbone"},
    "cli": {"commands"},
}
OURS = ("cli", "commands", "callbacks", "datamodules", "lightning_mods")


def layer_of(module: str) -> str:
    if module == "lightning_mods.backbone" or module.startswith("lightning_mods.backbone."):
        return "lightning_mods.backbone"
    return module.split(".")[0]


def imported_modules(path: Path, module: str) -> set[str]:
    """Absolute names of the modules of ours that ``path`` (module ``module``) imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return {name for name in found if name.split(".")[0] in OURS and is_our_module(name)}


def is_our_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def source_modules() -> list[tuple[Path, str]]:
    files = [ROOT / "cli.py"] + [p for package in OURS[1:] for p in sorted((ROOT / package).rglob("*.py"))]
    return [(p, ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")) for p in files]


@pytest.mark.parametrize("path, module", source_modules(), ids=[module for _, module in source_modules()])
def test_imports_point_down_the_layers(path, module):
    layer = layer_of(module)
    wrong = sorted(name for name in imported_modules(path, module)
                   if layer_of(name) != layer and layer_of(name) not in ALLOWED[layer])
    assert not wrong, f"{module} ({layer}) imports {wrong}; allowed: {sorted(ALLOWED[layer])}"


def test_the_checker_sees_a_wrong_arrow(tmp_path):
    """The check itself can fail: a backbone module importing a LightningModule is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from lightning_mods.mae import MaskedAutoencoder\nfrom ..optim import scaled_lr\n")
    names = imported_modules(bad, "lightning_mods.backbone.bad")
    assert "lightning_mods.mae" in names and "lightning_mods.optim" in names
    assert {layer_of(n) for n in names} == {"lightning_mods"}
