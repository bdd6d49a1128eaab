"""Where the tests are: the root (``conftest.py``, the ``helpers`` package) and one folder per
package, as the package is laid out.

:data:`PATHS` puts every test folder on ``sys.path`` (``conftest.py``): the helpers are imported
as ``helpers.<module>`` and test modules import each other by module name (``from test_cli import
TINY_MAE``); :data:`PYTHONPATH` does the same for the processes the tests start."""
from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
FOLDERS = [TESTS, *sorted(p for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))]
PATHS = [str(p) for p in FOLDERS]
# the processes the tests start import no wandb (helpers/without_wandb/wandb.py says why)
WITHOUT_WANDB = str(TESTS / "helpers" / "without_wandb")
PYTHONPATH = os.pathsep.join([str(REPO), *PATHS, WITHOUT_WANDB])
