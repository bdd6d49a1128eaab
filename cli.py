"""The ``shortcutlab`` command.

    shortcutlab fit --config configs/digits_mae.yaml        # LightningCLI: fit/validate/test/predict
    shortcutlab sweep ... / shortcutlab report runs/<experiment>
    shortcutlab convert-mae / feature-reuse / probe-diffusion / encode-latents

Training subcommands go to LightningCLI (:mod:`commands.lightning_cli`); the others each have a
module in :mod:`commands` (also runnable as ``python -m commands.<name>``). Import arrows run one
way: ``cli`` -> ``commands`` -> ``callbacks``/``datamodules`` -> ``lightning_mods`` ->
``lightning_mods.backbone``.
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional

from commands.lightning_cli import console_main as lightning_console_main

# subcommand -> (module in commands/, one-line description)
COMMANDS = {
    "sweep": ("commands.sweep", "run a grid of fits (alpha_min x seed ...) one after another, or print their commands"),
    "report": ("commands.report", "a sweep's table (mean ± std over seeds) and figures from runs/<experiment>"),
    "convert-mae": ("commands.convert_mae", "import the authors', official or timm MAE weights; export to timm"),
    "feature-reuse": ("commands.feature_reuse", "the spiral feature-reuse study (ResidualDroppath paper, Fig. 3)"),
    "probe-diffusion": ("commands.probe_diffusion", "linear probe / kNN of a diffusion model's blocks per noise level"),
    "encode-latents": ("commands.encode_latents", "encode a dataset with the frozen VAE for latent diffusion"),
}


def run_command(name: str, args: list[str]) -> None:
    """Run the ``commands`` module of subcommand ``name`` on ``args``."""
    module = importlib.import_module(COMMANDS[name][0])
    module.main(args)


def console_main(argv: Optional[list[str]] = None) -> None:
    """The ``shortcutlab`` console command."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in COMMANDS:
        run_command(args[0], args[1:])
        return
    if argv is not None:
        sys.argv = [sys.argv[0], *args]
    lightning_console_main()


if __name__ == "__main__":
    console_main()
