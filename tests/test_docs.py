"""The user guide is tested: the README is a front page (<= 200 lines); every
shell and Python block of the README and ``docs/`` is run by a test or marked as needing what
this machine has not; relative links between the pages resolve; and the blocks marked as run
here are run, as a user following the page would, with a short budget.

A block's mark is an HTML comment on the line before its fence:

- ``<!-- tested: tests/test_x.py ... -->``: the named test files exist and name the page
  (they read the block, or run its commands); ``tests/test_docs.py`` means this file runs the
  block itself (below);
- ``<!-- not run here: needs a GPU | a dataset | a cluster | downloaded weights | a Hugging Face account ... -->``.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUNNABLE = {"bash", "sh", "shell", "console", "python", "py"}
MARK = re.compile(r"^\s*<!--\s*(tested|not run here):\s*(.*?)\s*-->\s*$")
NEEDS = re.compile(r"needs (a GPU|a dataset|a cluster|downloaded weights|a Hugging Face account)")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
BUDGET = {
    "fit": ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false"],
    "validate": ["--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false"],
    "predict": ["--trainer.limit_predict_batches=2", "--trainer.enable_progress_bar=false"],
}
SMALL_MAE = ["--model.network.depth=2", "--model.network.decoder_depth=1"]  # the quickstart's MAE, 2 encoder blocks: part of the budget
MAE_WORDS = re.compile(r"configs/digits_mae\.yaml|MaskedAutoencoder")


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def code_blocks(page: Path) -> list[dict]:
    """Every fenced block: language, mark (kind, text) or None, code, line number."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(before)
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:end])
        found.append({"lang": lang, "mark": mark.groups() if mark else None, "code": code, "line": i + 1})
        i = end + 1
    return found


def runnable_blocks() -> list[tuple[Path, dict]]:
    return [(page, block) for page in PAGES for block in code_blocks(page) if block["lang"] in RUNNABLE]


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_every_shell_and_python_block_is_tested_or_marked():
    problems = []
    for page, block in runnable_blocks():
        where = f"{page_name(page)}:{block['line']}"
        if block["mark"] is None:
            problems.append(f"{where}: neither tested nor marked")
            continue
        kind, text = block["mark"]
        if kind == "not run here":
            if not NEEDS.search(text):
                problems.append(f"{where}: 'not run here' must say what it needs (a GPU, a dataset, a cluster, ...)")
            continue
        runners = re.findall(r"(tests/[\w/]+\.py|\.ci/run)", text)
        if not runners:
            problems.append(f"{where}: 'tested' names no test file")
        for runner in runners:
            path = ROOT / runner
            if not path.is_file():
                problems.append(f"{where}: {runner} does not exist")
            elif runner.startswith("tests/") and runner != "tests/test_docs.py" \
                    and page_name(page) not in path.read_text():
                problems.append(f"{where}: {runner} does not name {page_name(page)}")
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = unicodedata.normalize("NFKC", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    in_code, found = False, set()
    for line in page.read_text().splitlines():
        if FENCE.match(line) or line.strip() == "```":
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def test_relative_links_between_pages_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page_name(page)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page_name(page)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def as_run_here(code: str, root_dir: Path) -> str:
    """A shell block as this test runs it: continuation lines joined, each fit/validate/predict
    with a short budget (and the quickstart MAE with 2 encoder blocks), a sweep with ``--print`` (every run's config parsed, one line per run,
    nothing trained), ``report`` left out (it needs the finished sweep: tests/commands/test_sweep_report.py),
    ``make demo`` with a short budget and ``make test`` left out (.ci/run runs it)."""
    script = []
    for line in code.replace("\\\n", " ").splitlines():
        command, _, comment = line.partition("  #")
        words = command.split()
        if len(words) >= 2 and words[0] == ".venv/bin/shortcutlab" and ".help" not in command and "--help" not in command:
            sub = words[1]
            if sub in BUDGET:
                command += " " + " ".join(BUDGET[sub] + (SMALL_MAE if MAE_WORDS.search(command) else []))
            elif sub == "sweep":
                command += " --print --runs-dir runs > /dev/null"
            elif sub == "report":
                command = ": report needs the finished sweep"
        elif words[:2] == ["make", "demo"]:
            budget = " ".join(BUDGET["fit"] + SMALL_MAE + [f"--trainer.default_root_dir={root_dir / 'demo'}"])
            command = f"make -C {ROOT} demo ARGS='{budget}'"
        elif words[:2] == ["make", "test"]:
            command = ": .ci/run runs make test"
        script.append(command)
    return "\n".join(script)


def session(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A folder as a user's checkout: configs and examples, and ``.venv`` the running one."""
    for name in ("configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))  # the environment running the tests
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    return tmp_path, env


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(b["mark"] and "tests/test_docs.py" in b["mark"][1]
                                                          for b in code_blocks(p) if b["lang"] in RUNNABLE)],
                         ids=page_name)
def test_the_blocks_this_file_runs_run(page, tmp_path, warm_shortcutlab):
    """The page's blocks marked ``tests/test_docs.py``, in order, in one folder (a later block
    may read what an earlier one wrote, as on the page). ``.venv/bin/shortcutlab`` runs through a
    warm fork of the CLI (tests/helpers/fork_server.py: the same ``console_main``, arguments, folder,
    environment and streams, without importing torch and Lightning anew for each command)."""
    folder, env = session(tmp_path)
    run_blocks(page, folder, env, " ".join(warm_shortcutlab))


def run_blocks(page: Path, folder: Path, env: dict[str, str], shortcutlab: str) -> None:
    for block in code_blocks(page):
        if block["lang"] not in RUNNABLE or not block["mark"] or "tests/test_docs.py" not in block["mark"][1]:
            continue
        if block["lang"] in ("python", "py"):
            (folder / "block.py").write_text(block["code"])
            run = subprocess.run([sys.executable, "block.py"], cwd=folder, env=env, capture_output=True, text=True,
                                 timeout=600)
        else:
            script = re.sub(r"(^|[;&|(]\s*)\.venv/bin/shortcutlab(?= )", lambda m: m.group(1) + shortcutlab,
                            as_run_here(block["code"], folder), flags=re.M)
            run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=folder,
                                 env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"{page_name(page)}:{block['line']}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"


HISTORY = re.compile(r"\b[Ii]ssues? \d+|\b[Ss]essions?\b|\bruns? \d+(?![\d-])|\bSPEC\b|development checkout"
                     r"|\bcommit `?[0-9a-f]{7,40}\b|`[0-9a-f]{7,40}`")  # a commit is history too


def test_the_pages_speak_to_the_user_not_of_how_the_package_was_built():
    """No issue numbers, work sessions, runs by number or files a user does not have (SPEC.md):
    the papers' sections and commands anyone can rerun instead."""
    pages = PAGES + sorted((ROOT / "configs").rglob("*.md")) + [ROOT / "benchmarks" / "results.md"]
    found = [f"{page_name(page)}:{n}: {line.strip()[:80]}" for page in pages
             for n, line in enumerate(page.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert found == []


def test_the_history_check_sees_history():
    assert HISTORY.search("as issue 18 asked") and HISTORY.search("in the seventh session")
    assert HISTORY.search("runs 5 and 6") and HISTORY.search("SPEC section 2")
    assert not HISTORY.search("classes run 0-4 and 5-9 along the rows")
    assert HISTORY.search("from commit `9d5f394`") and HISTORY.search("at `e8ee379`")
    assert not HISTORY.search("a rank of 9.513596534729004")


def yaml_blocks() -> list[tuple[Path, dict]]:
    return [(page, block) for page in PAGES for block in code_blocks(page) if block["lang"] in ("yaml", "yml")]


def leaves(value, path=()):  # noqa: ANN001, ANN201
    """``(path, value)`` of every leaf of a YAML tree; a class path by its class name (a config may
    give a short import path, the resolved config writes the defining module's)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif path and path[-1] == "class_path":
        yield path, str(value).rpartition(".")[2]
    else:
        yield path, value


def resolved_leaf(config: dict, path: tuple):  # noqa: ANN001, ANN201
    """The resolved config's value at a block's ``path``, through the ``init_args`` levels the block
    leaves out (LightningCLI takes ``model: {network: ...}`` for ``model: {init_args: {network: ...}}``)."""
    node = config
    for key in path:
        if isinstance(node, dict) and key not in node and "init_args" in node:
            node = node["init_args"]
        node = node[key]
    return str(node).rpartition(".")[2] if path[-1] == "class_path" else node


@pytest.mark.parametrize("page, block", yaml_blocks(), ids=[f"{page_name(p)}:{b['line']}" for p, b in yaml_blocks()])
def test_every_yaml_block_parses_with_the_config_it_belongs_to(page, block, tmp_path, monkeypatch):
    """A YAML block is a piece of a config: its mark names the config files it goes with
    (``composed with configs/...``), and LightningCLI composes them and keeps every value of the
    block (or its mark names the test that runs it)."""
    from helpers.composed_configs import resolved_config

    assert block["mark"] and block["mark"][0] == "tested", f"{page_name(page)}:{block['line']}: YAML block without a mark"
    text = block["mark"][1]
    configs = re.findall(r"configs/[\w/.-]+\.yaml", text.split("composed with", 1)[1]) if "composed with" in text else []
    if not configs:
        assert re.search(r"tests/[\w/]+\.py", text) and "tests/test_docs.py" not in text, text
        return
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # a page's own classes (docs/extending.md)
    (tmp_path / "block.yaml").write_text(block["code"])
    parsed = yaml.safe_load(block["code"])
    resolved = resolved_config([*(f"--config={ROOT / c}" for c in configs), f"--config={tmp_path / 'block.yaml'}"])
    assert resolved, f"{page_name(page)}:{block['line']}: LightningCLI refused the block composed with {configs}"
    for path, value in leaves(parsed):
        assert resolved_leaf(resolved, path) == value, (page_name(page), path)
