"""``shortcutlab sample``: images from a diffusion checkpoint, with any sampler, number of steps and
guidance (how it samples is not what it learned: none of these need to match the checkpoint).

    shortcutlab sample runs/digits_diffusion --sampler ddim --num-steps 50 --guidance-scale 2 --out samples/
    shortcutlab sample model.ckpt --num-images 64 --seed 3 --out samples/

The checkpoint is a file of ``shortcutlab fit`` with a ``DiffusionModule`` or a run's folder (the
final checkpoint of its finished fit, as ``model.checkpoint`` takes it); its network, weights
(the averaged ones where the run kept an EMA: Lightning saves those as the model's) and settings
come from it. Writes
``<out>/<index>.png`` (the images in [0, 1], one file each; ``_class<c>`` added for a class-conditional
model) and ``<out>/grid.png``: ``--num-images`` samples in a near-square grid, one row a class
spread over the classes (digits, 16 images: classes 0, 3, 6 and 9, four each), titled with the
checkpoint's epoch and step, the sampler, steps, guidance and seed. The defaults are the model's own.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import lightning_mods.exit_statuses as exit_statuses

SAMPLERS = ("ddpm", "ddim", "dpmsolver++", "dpmsolver++_singlestep", "euler_maruyama")
DIFFUSION = "lightning_mods.diffusion.DiffusionModule"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shortcutlab sample", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("checkpoint", help="a DiffusionModule checkpoint of shortcutlab fit, or its run's folder")
    parser.add_argument("--out", default="samples", help="folder for the images and grid.png (made when missing)")
    parser.add_argument("--sampler", choices=SAMPLERS, default=None, help="default: the model's")
    parser.add_argument("--num-steps", type=int, default=None, help="sampling steps (default: the model's)")
    parser.add_argument("--guidance-scale", type=float, default=None,
                        help="classifier-free guidance of a class-conditional model (1 = none; default: the model's)")
    parser.add_argument("--num-images", type=int, default=16, help="this many images (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="the samples' noise (default 0)")
    return parser


def sample(args: argparse.Namespace) -> list[Path]:
    """Write the images and the grid of ``args``; returns the files written, the grid last."""
    import torch

    from lightning_mods.checkpointing._finished_run import chosen_checkpoint
    from lightning_mods.checkpointing.rebuild import canonical_class_path, load_run, read_torch_file
    from lightning_mods.pictures.grids import figure_to_array, save_png

    if args.num_images < 1:
        raise ValueError(f"--num-images: must be >= 1, got {args.num_images}")
    path = chosen_checkpoint(args.checkpoint, "shortcutlab sample")
    module, _ = load_run(path, with_data=False)
    if canonical_class_path(f"{type(module).__module__}.{type(module).__qualname__}") != DIFFUSION:
        raise ValueError(f"checkpoint: {path} is a {type(module).__name__} checkpoint, not a DiffusionModule's")
    ckpt = read_torch_file(path, "checkpoint", mmap=True)
    module.note_checkpoint_position(ckpt)  # the grid's title names the checkpoint's epoch and step
    module.eval()
    with torch.no_grad():
        figure, images, labels = module.sample_grid(args.num_images, args.seed, args.sampler, args.num_steps,
                                                    args.guidance_scale)
    out = Path(args.out)
    written = []
    for index, image in enumerate(images.permute(0, 2, 3, 1).float().cpu().numpy()):
        suffix = "" if labels is None else f"_class{int(labels[index])}"
        written.append(save_png(image, out / f"{index:05d}{suffix}.png"))
    written.append(save_png(figure_to_array(figure), out / "grid.png"))
    return written


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        written = sample(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"shortcutlab sample: error: {err}", file=sys.stderr)
        sys.exit(exit_statuses.BAD_INPUT)
    print(f"wrote {len(written) - 1} images and {written[-1]}")


if __name__ == "__main__":
    main()
