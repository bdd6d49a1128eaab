"""``shortcutlab export``: a trained network as a folder in timm's hub layout, which
``timm.create_model("local-dir:FOLDER", pretrained=True)`` rebuilds and ``push_to_hf_hub`` /
``upload_folder`` publish.

    shortcutlab export runs/digits_mae/lightning_logs/version_0/checkpoints/last.ckpt exported/digits_mae_encoder
    shortcutlab export CHECKPOINT FOLDER --part whole      # an MAE with its decoder

The folder holds ``config.json`` (the timm name, every argument of the network with its
shortcut schedule, the data's input size, mean, std and class names), ``model.safetensors`` and
``README.md``, a model card with the run's settings, data, epochs, the numbers it measured and
the paper to cite. An MAE exports its encoder (a ``vit_*_decayed``, unpooled tokens) unless
``--part whole``; a classifier its ResNet with its head; a diffusion model its U-ViT.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import lightning_mods.exit_statuses as exit_statuses


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shortcutlab export", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("checkpoint", type=Path, help="a checkpoint of a shortcutlab fit (.ckpt)")
    parser.add_argument("folder", type=Path, help="the folder to write (missing parents are created)")
    parser.add_argument("--part", choices=("auto", "encoder", "whole"), default="auto",
                        help="of an MAE: its encoder (auto, encoder) or the whole network with its decoder")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty folder")
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    from lightning_mods.checkpointing.hub_export import export_checkpoint

    try:
        folder, export = export_checkpoint(args.checkpoint, args.folder, args.part, args.overwrite)
    except (ValueError, OSError) as err:
        print(f"shortcutlab export: error: {err}", file=sys.stderr)
        sys.exit(exit_statuses.BAD_INPUT)
    print(f"wrote {folder}: {export.what} as {export.architecture} (config.json, model.safetensors, README.md); "
          f"load it with timm.create_model('local-dir:{folder}', pretrained=True) after import lightning_mods.backbone")


if __name__ == "__main__":
    main()
