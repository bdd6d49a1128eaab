"""Run the installed timm release's own model tests on the registered decayed encoders.

timm writes its model contract down as ``tests/test_models.py`` (in its source distribution on
PyPI, not in the wheel). This fetches that file for the installed version, registers the decayed
networks before it is collected, and runs every test of it whose model name ends in
``_decayed``, for the encoders (``vit_*_decayed``, ``resnet*_decayed``), TorchScript aside.
One change is made to the fetched file, and printed: the registry module joins the list of
modules whose models timm checks ``forward_intermediates`` and its ``features_only`` getter on.

    make timm-tests                      # about 8 minutes on a 2-core CPU
    make timm-tests ARGS="--workers 4 --keep /tmp/timm-src"
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import timm

ROOT = Path(__file__).resolve().parents[1]
SELECTION = "_decayed and not torchscript and not mae_ and not uvit_"
FEATURE_MODULES = "FEAT_INTER_FILTERS = ["


def fetch_tests(version: str, folder: Path) -> Path:
    """timm's ``tests/`` folder of ``version``, from its source distribution on PyPI."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                    f"timm=={version}", "--dest", str(folder)], check=True)
    archive = next(folder.glob(f"timm-{version}.tar.gz"))
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"timm-{version}/tests/")]
        tar.extractall(folder, members=members, filter="data")
    return folder / f"timm-{version}" / "tests"


def prepare(tests: Path) -> None:
    """Register the decayed networks before collection; let timm check their ``forward_intermediates``."""
    models = tests / "test_models.py"
    text = models.read_text()
    if FEATURE_MODULES not in text:
        raise SystemExit(f"timm-tests: {models} has no {FEATURE_MODULES.strip(' =[')}; this timm release "
                         "lists its forward_intermediates models another way")
    models.write_text(text.replace(FEATURE_MODULES, FEATURE_MODULES + "'timm_registry', ", 1))
    print(f"timm-tests: {models.name}: 'timm_registry' added to {FEATURE_MODULES.strip(' =[')}")
    conftest = tests / "conftest.py"
    conftest.write_text((conftest.read_text() if conftest.exists() else "")
                        + "\n\nimport lightning_mods.backbone  # noqa: E402,F401 (registers the decayed networks)\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.timm_model_tests", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    parser.add_argument("--keep", type=Path, default=None, help="fetch into this folder and keep it")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        tests = fetch_tests(timm.__version__, folder)
        prepare(tests)
        print(f"timm-tests: timm {timm.__version__}'s tests/test_models.py, -k {SELECTION!r}")
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "test_models.py", "-k", SELECTION,
                              "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestUnknownMarkWarning",
                              "-n", str(args.workers)], cwd=tests, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
