"""Stands for wandb in the processes the tests start (``folders.PYTHONPATH``), none of which logs
to W&B: timm imports wandb at its own import whenever it is installed (``timm.utils.summary``),
about 1.3 s of every process start on a 2-core CPU. These processes run as on a machine without
wandb, as timm expects (it catches the ImportError); the loggers' tests run W&B in the test
process itself (tests/run_outputs/test_loggers.py)."""
raise ImportError("wandb is left out of the processes the tests start (tests/helpers/without_wandb)")
