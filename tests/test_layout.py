"""The import arrows of the layout (README.md "Layout") run one way:
``cli`` -> ``commands`` -> ``callbacks`` / ``datamodules`` -> ``lightning_mods`` -> ``lightning_mods.backbone``;
inside the two big packages, the role folders sit under what uses them: the LightningModules over
their helper sub-packages, the callbacks over their shared bases and internal helpers. And no
two modules import each other, directly or round a circle.

Read from the source with ``ast`` (imports inside functions included), so a lazy import that
points the wrong way fails too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULE_HELPERS = ("checkpointing", "_compat", "evaluation", "_generation", "pictures", "recipe", "run_outputs",
                  "exit_statuses")
CALLBACK_BASES = ("_utils", "schedule", "settings_key", "cost")
# layer -> the layers it may import (besides itself and third-party packages)
BELOW_MODULES = {"lightning_mods.helpers", "lightning_mods.backbone"}
ALLOWED = {
    "lightning_mods.backbone": set(),
    "lightning_mods.helpers": {"lightning_mods.backbone"},
    "lightning_mods": BELOW_MODULES,
    "datamodules": {"lightning_mods"} | BELOW_MODULES,
    "callbacks.bases": {"lightning_mods", "datamodules"} | BELOW_MODULES,
    "callbacks": {"callbacks.bases", "lightning_mods", "datamodules"} | BELOW_MODULES,
    "commands": {"callbacks", "callbacks.bases", "datamodules", "lightning_mods"} | BELOW_MODULES,
    "cli": {"commands"},
}
OURS = ("cli", "commands", "callbacks", "datamodules", "lightning_mods")


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "lightning_mods" and len(parts) > 1:
        if parts[1] == "backbone":
            return "lightning_mods.backbone"
        if parts[1] in MODULE_HELPERS:
            return "lightning_mods.helpers"
    if parts[0] == "callbacks" and len(parts) > 1 and parts[1] in CALLBACK_BASES:
        return "callbacks.bases"
    return parts[0]


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
    bad.write_text("from lightning_mods.mae import MaskedAutoencoder\nfrom ..recipe.optim import scaled_lr\n")
    names = imported_modules(bad, "lightning_mods.backbone.bad")
    assert "lightning_mods.mae" in names and "lightning_mods.recipe.optim" in names
    assert {layer_of(n) for n in names} == {"lightning_mods", "lightning_mods.helpers"}
    assert layer_of("callbacks._utils.distributed") == "callbacks.bases"
    assert "lightning_mods" not in ALLOWED["lightning_mods.helpers"]


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (packages' ``__init__`` as the package)."""
    graph = {}
    for path, module in source_modules():
        graph[module] = {name for name in imported_modules(path, module) if name != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (Tarjan's strongly connected components of two or more)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_the_circle_finder_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_exit_statuses_are_defined_once_and_match_the_documented_table():
    """One module of exit statuses: no command exits with a bare number, and docs/reliability.md's
    table names the same numbers."""
    import re

    from lightning_mods import exit_statuses

    bare = [f"{path.relative_to(ROOT)}:{n}" for folder in OURS for path in sorted(ROOT.glob(f"{folder}/**/*.py"))
            + sorted(ROOT.glob(f"{folder}.py")) for n, line in enumerate(path.read_text().splitlines(), 1)
            if re.search(r"sys\.exit\(\d|SystemExit\(\d|EXIT_STATUS = \d", line)]
    assert bare == []
    table = (ROOT / "docs" / "reliability.md").read_text()
    for status in (exit_statuses.SWEEP_RUN_FAILED, exit_statuses.BAD_INPUT, exit_statuses.DIVERGED,
                   exit_statuses.DISK_ERROR, exit_statuses.LOST_RANK):
        assert f"\n| {status} | " in table
    assert exit_statuses.stopped_by(15) == 143 and "| 130 / 143 |" in table


def test_no_module_over_400_lines_and_no_function_over_60():
    """A module or function that long does several things: split it by what it does."""
    long_modules, long_functions = [], []
    for folder in OURS:
        for path in sorted(ROOT.glob(f"{folder}/**/*.py")) + sorted(ROOT.glob(f"{folder}.py")):
            source = path.read_text()
            if len(source.splitlines()) > 400:
                long_modules.append(f"{path.relative_to(ROOT)}: {len(source.splitlines())} lines")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                                          f"{node.end_lineno - node.lineno + 1} lines")
    assert long_modules == [] and long_functions == []


def test_commands_rebuild_a_checkpoint_only_through_load_run():
    """One way to rebuild a run: the commands call ``rebuild.load_run``, never the pieces it is
    made of, nor a datamodule from a checkpoint's settings of their own."""
    pieces = ("module_from_checkpoint", "build_module", "datamodule_hyper_parameters", "load_checkpoint(")
    found = [f"{path.relative_to(ROOT)}: {piece}" for path in sorted((ROOT / "commands").glob("*.py")) + [ROOT / "cli.py"]
             for piece in pieces if piece in path.read_text()]
    assert found == []
    users = {path.name for path in (ROOT / "commands").glob("*.py") if "load_run(" in path.read_text()}
    assert {"features.py", "convert_mae.py", "probe_diffusion.py"} <= users


def test_every_shipped_callback_has_its_test_file():
    """Tests mirror the package: tests/callbacks/test_<module>.py (or test_<class in snake case>.py)
    for each callback of ``shortcutlab --help``."""
    import re

    from commands import _catalogue as catalogue

    have = {p.name for p in (ROOT / "tests" / "callbacks").glob("test_*.py")}
    missing = []
    for found in catalogue.find("callback"):
        parts = found.module.split(".")
        module = parts[-2] if parts[-1] == "probe" else parts[-1]  # the online probe is a package
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", found.name).lower()
        if not {f"test_{module}.py", f"test_{snake}.py"} & have:
            missing.append(f"{found.class_path}: tests/callbacks/test_{module}.py")
    assert missing == []


def test_each_module_name_occurs_once():
    """A module or package name says which one it is: no two modules of the package and its
    benchmarks share a name (``fid.py`` or ``training/`` in two places read alike in a traceback)."""
    import collections

    names = collections.Counter()
    for folder in (*OURS[1:], "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            names[path.parent.name if path.name == "__init__.py" else path.stem] += 1
    names["cli"] += 1
    assert sorted(name for name, count in names.items() if count > 1 and name != "__main__") == []


def test_what_no_config_or_page_names_is_private():
    """Infrastructure is private: a module that no config, no page of the user guide (README,
    docs/, configs/README.md) and no command names, that defines no class a config can name and
    none of its package's ``__all__``, has a name (or sits in a package) starting with ``_``."""
    import cli
    from commands import _catalogue as catalogue

    def exported(path: Path) -> bool:
        package, names = path.parent / "__init__.py", set()
        for node in ast.parse(package.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                names = set(ast.literal_eval(node.value))
        defined = {node.name for node in ast.parse(path.read_text()).body
                   if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
        return bool(names & defined)

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "configs").rglob("*.md")),
             *sorted((ROOT / "configs").rglob("*.yaml"))]
    text = "\n".join(page.read_text() for page in pages)
    public = {found.module for kind in catalogue.KINDS for found in catalogue.find(kind)}
    public |= {module for module, _ in cli.COMMANDS.values()}
    unnamed = []
    for path, module in source_modules():
        if path.name == "__init__.py" or any(part.startswith("_") for part in module.split(".")) or module == "cli":
            continue
        if module in public or module in text or path.relative_to(ROOT).as_posix() in text or exported(path):
            continue
        unnamed.append(module)
    assert unnamed == []


def test_the_suite_runs_with_warnings_as_errors_and_each_tolerated_warning_has_its_reason():
    """setup.cfg: ``error`` first, then every ignored warning once, each group under a comment saying why."""
    text = (ROOT / "setup.cfg").read_text()
    block = text[text.index("filterwarnings =\n") + len("filterwarnings =\n"):]
    lines = []
    for line in block.splitlines():
        if not line.startswith("    "):
            break
        lines.append(line.strip())
    assert lines[0] == "error"
    filters = [line for line in lines if not line.startswith("#")]
    assert all(f.startswith("ignore:") for f in filters[1:]) and len(set(filters)) == len(filters)
    assert len(filters) > 1
    for before, line in zip(lines[1:], lines[2:]):
        if line.startswith("ignore:") and not before.startswith("#"):
            assert before.startswith("ignore:"), line  # the same reason as the line before it
    assert lines[1].startswith("#")


def test_what_runs_write_into_the_checkout_is_ignored_by_git():
    """A run's folders in the working directory (MLflow's default mlruns/ among them) never show up as changes."""
    import subprocess

    for path in ("runs/digits_mae/x", "lightning_logs/version_0/x", "mlruns/0/meta.yaml"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, path
