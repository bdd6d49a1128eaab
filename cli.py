"""The ``shortcutlab`` command.

    shortcutlab                                             # overview: models, data, configs, commands
    shortcutlab fit --config configs/digits_mae.yaml        # LightningCLI: fit/validate/test/predict
    shortcutlab sweep ... / shortcutlab report runs/<experiment>
    shortcutlab convert-mae / feature-reuse / probe-diffusion / encode-latents / sort-imagenet-val
    shortcutlab score-bank FOLDER --k 10 20 100 200         # a saved kNN bank at other settings
    shortcutlab export CHECKPOINT FOLDER                    # the network in timm's hub layout
    shortcutlab chunks SOURCE DEST                          # ImageNet as streaming chunks (litdata)

Training subcommands go to LightningCLI (:mod:`commands.lightning_cli`); the others each have a
module in :mod:`commands` (also runnable as ``python -m commands.<name>``). Import arrows run one
way: ``cli`` -> ``commands`` -> ``callbacks``/``datamodules`` -> ``lightning_mods`` ->
``lightning_mods.backbone``. The overview imports neither torch nor Lightning (it reads the
class list from the source, :mod:`commands._catalogue`), so it prints at once.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent
# the package's top-level packages: a file or folder of the same name earlier on sys.path (a
# researcher's own callbacks.py in the folder on PYTHONPATH) would be imported in their place
PACKAGES = ("commands", "callbacks", "datamodules", "lightning_mods")


def shadowing_file(name: str) -> Optional[Path]:
    """The file or folder that ``import name`` finds before this package's own, if any."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    # a folder without __init__.py (a namespace portion, such as a tests/ folder of the same name) hides
    # nothing: the package's own modules are still found under that name
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen") or spec.loader is None:
        return None
    found = Path(spec.origin)
    found = found.parent if found.name == "__init__.py" else found
    return None if found.resolve().is_relative_to(ROOT / name) else found


def _exit_statuses():  # noqa: ANN202
    """lightning_mods/exit_statuses.py read from its file: the package may be the hidden one."""
    spec = importlib.util.spec_from_file_location("_shortcutlab_exit_statuses",
                                                  ROOT / "lightning_mods" / "exit_statuses.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_package_names() -> None:
    """One line and exit status 2 when a file of the user's hides one of the package's packages."""
    for name in PACKAGES:
        found = shadowing_file(name)
        if found is not None:
            print(f"shortcutlab: error: {found} hides shortcutlab's own '{name}' package (its folder is earlier on "
                  f"sys.path, e.g. through PYTHONPATH); rename it (say my_{name}{'.py' if found.suffix else ''}) and "
                  "name your classes by the new module", file=sys.stderr)
            sys.exit(_exit_statuses().BAD_INPUT)


check_package_names()  # before the first import of one of them

from commands import _catalogue as catalogue  # noqa: E402

# subcommand -> (module in commands/, one-line description)
COMMANDS = {
    "sweep": ("commands.sweep", "run a grid of fits (alpha_min x seed ...) one after another, or print their commands"),
    "report": ("commands.report", "a sweep's table (mean ± std over seeds) and figures from runs/<experiment>"),
    "sample": ("commands.sample", "images and their grid from a diffusion checkpoint, with any sampler, steps and "
                                  "guidance"),
    "score-bank": ("commands.score_bank", "score a kNN bank saved by KNNEvaluator(save_features=...) at other k, "
                                          "temperatures or blocks, without embedding the training set again"),
    "features": ("commands.features", "the patch-feature picture of a checkpoint (top-3 principal components as RGB)"),
    "export": ("commands.export", "a trained network (MAE encoder or whole MAE, ResNet, U-ViT) as a folder in timm's hub "
                                  "layout: config.json, model.safetensors, model card"),
    "convert-mae": ("commands.convert_mae", "import the authors', official or timm MAE weights; export to timm"),
    "feature-reuse": ("commands.feature_reuse", "the spiral feature-reuse study (ResidualDroppath paper, Fig. 3)"),
    "probe-diffusion": ("commands.probe_diffusion", "linear probe / kNN of a diffusion model's blocks per noise level"),
    "encode-latents": ("commands.encode_latents", "encode a dataset with the frozen VAE for latent diffusion"),
    "sort-imagenet-val": ("commands.sort_imagenet_val", "sort ImageNet's validation images into class folders"),
    "chunks": ("commands.chunks", "convert an ImageFolder tree (ImageNet) into streaming chunks read from local disk, a "
                                  "shared filesystem or object storage"),
}
RENAMED_COMMANDS = {"shards": "chunks"}  # old name -> its name since release 0.3 (still run, with a notice)
# LightningCLI's subcommands (Trainer methods)
TRAINING = {
    "fit": "train a model (validation and checkpoints as the config sets them)",
    "validate": "one pass over the validation split, e.g. of a checkpoint (--ckpt_path FILE)",
    "test": "one pass over the test split (--ckpt_path FILE)",
    "predict": "write the model's outputs on the held-out split (predictions.pt in the log folder)",
}
CONFIGS = Path(__file__).resolve().parent / "configs"
QUICKSTART = "shortcutlab fit --config configs/digits_mae.yaml"
WIDTH = 100


def _rows(rows: list[tuple[str, str]]) -> list[str]:
    """``name  description`` lines, the descriptions aligned and wrapped."""
    pad = max(len(name) for name, _ in rows) + 4
    return [line for name, text in rows
            for line in textwrap.wrap(text, WIDTH, initial_indent=f"  {name:<{pad - 2}}", subsequent_indent=" " * pad,
                                       break_on_hyphens=False)]


def overview() -> str:
    """The text of ``shortcutlab`` and ``shortcutlab --help``."""
    configs = sorted(CONFIGS.rglob("*.yaml")) if CONFIGS.is_dir() else []
    lines = [
        "usage: shortcutlab <command> [options]     (shortcutlab <command> --help: its options)",
        "",
        "Decayed identity shortcuts (MAE, ResNet, U-ViT diffusion) and ResidualDroppath in Lightning.",
        "",
        f"Quickstart (the bundled digits, CPU, minutes):  {QUICKSTART}",
        "",
        "Training commands (LightningCLI; settings from --config files and --key=value, later ones win):",
        *_rows(list(TRAINING.items())),
        "  Classes go by their short name and settings by their dotted key, e.g.",
        "    shortcutlab fit --model MaskedAutoencoder --model.network MaskedAutoencoderViT --data Digits",
        "      --model.network.shortcut.alpha_min 0.8  (its settings: --model NAME --model.network.help NAME)",
        "  shortcutlab fit --model.help NAME / --data.help NAME: a class's settings;",
        "  shortcutlab fit --config FILE --print_config: the full resolved config.",
        "",
        "Models (--model NAME). The three families (docs/getting-started.md) are MaskedAutoencoder,",
        "ImageClassifier (+ the ResidualDroppath callback) and DiffusionModule:",
        *_rows([(f.name, f.summary) for f in catalogue.find("model")]),
        "",
        "Data (--data NAME):",
        *_rows([(f.name, f.summary) for f in catalogue.find("data")]),
        "",
        "Callbacks (a config adds to the defaults with trainer.callbacks+, or --trainer.callbacks+=NAME;",
        "[when each works: per step, per validation, per checkpoint, once]; docs/callbacks.md):",
        *_rows([(f.name, f"[{f.cost}] {f.summary}") for f in catalogue.find("callback")]),
        "",
        f"Configs: configs/ ({len(configs)} YAML files; configs/README.md says what each one reproduces)"
        if configs else "Configs: the configs/ folder of the source repository (configs/README.md).",
        "",
        "Other commands:",
        *_rows([(name, text) for name, (_, text) in COMMANDS.items()]),
    ]
    return "\n".join(lines)


def run_command(name: str, args: list[str]) -> None:
    """Run the ``commands`` module of subcommand ``name`` on ``args``."""
    module = importlib.import_module(COMMANDS[name][0])
    module.main(args)


def console_main(argv: Optional[list[str]] = None) -> None:
    """The ``shortcutlab`` console command."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(overview())
        return
    if args[0] in RENAMED_COMMANDS:
        print(f"shortcutlab: '{args[0]}' is '{RENAMED_COMMANDS[args[0]]}' since release 0.3", file=sys.stderr)
        args[0] = RENAMED_COMMANDS[args[0]]
    if args[0] in COMMANDS:
        run_command(args[0], args[1:])
        return
    from commands import reproducible_cpu

    try:
        if reproducible_cpu.requested(args):
            reproducible_cpu.enable()  # before the first import of torch, which reads it once
    except (ValueError, RuntimeError) as err:
        print(f"shortcutlab: error: {err}", file=sys.stderr)
        sys.exit(_exit_statuses().BAD_INPUT)
    from commands.lightning_cli import console_main as lightning_console_main  # torch: only when training

    lightning_console_main(None if argv is None else args)  # None: LightningCLI reads sys.argv itself


if __name__ == "__main__":
    console_main()
