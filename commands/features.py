"""``shortcutlab features``: the patch-feature picture of any checkpoint (the decay paper's
Figure 3, DINO's PCA view; :mod:`lightning_mods.pictures._patch_pca`).

    shortcutlab features --ckpt_path runs/digits_mae/.../last.ckpt --images val --out pictures/
    shortcutlab features --ckpt_path model.ckpt --images my_images/ --block 5 --out pictures/

The network is rebuilt from the checkpoint (class, settings and weights, as ``LinearProbe``
does). ``--images`` is ``val`` or ``train`` (the first ``--num-images`` images of that split of
the checkpoint's own datamodule, rebuilt from its saved settings; ``--data-set KEY=VALUE`` changes
one, e.g. ``data_dir=/data/cifar``) or a folder of image files (PNG, JPEG, BMP; sorted by name,
converted to the model's channels and resized to its image size, normalised with the
datamodule's mean and std). Writes ``<out>/patch_features_block<b>.png``: one column per image,
the input above its patch colours (at least 96 pixels per tile).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import lightning_mods.exit_statuses as exit_statuses

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shortcutlab features", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint of shortcutlab fit (MAE or classifier)")
    parser.add_argument("--images", default="val", help="val, train, or a folder of image files (default: val)")
    parser.add_argument("--out", default=".", help="folder for the picture (made when missing; default: .)")
    parser.add_argument("--block", type=int, default=-1, help="the block drawn (1 = nearest the input, -1 = the "
                                                              "last; default -1)")
    parser.add_argument("--num-images", type=int, default=8, help="images drawn (default 8)")
    parser.add_argument("--data-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the checkpoint's datamodule (repeatable), e.g. data_dir=/data/cifar")
    return parser


def data_settings(items: list[str]) -> dict[str, Any]:
    """``--data-set KEY=VALUE`` items as settings (values read as YAML: ``batch_size=32`` is a number)."""
    import yaml

    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--data-set: expected KEY=VALUE, got {item!r}")
        settings[key] = yaml.safe_load(value) if value else value
    return settings


def folder_images(folder: Path, count: int, channels: int, size: int, mean: list, std: list):  # noqa: ANN201
    """The first ``count`` image files of ``folder`` as model inputs ``N x C x size x size``."""
    import numpy as np
    import torch
    from PIL import Image, UnidentifiedImageError

    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:count]
    if not files:
        raise FileNotFoundError(f"--images: no image files ({', '.join(IMAGE_SUFFIXES)}) in '{folder}'")
    images = []
    for path in files:
        try:
            with Image.open(path) as image:
                image = image.convert("L" if channels == 1 else "RGB").resize((size, size), Image.BILINEAR)
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(f"--images: cannot read '{path}' ({err})") from None
        array = np.asarray(image, dtype=np.float32) / 255.0
        images.append(torch.from_numpy(array.reshape(size, size, channels)).permute(2, 0, 1))
    batch = torch.stack(images)
    return (batch - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)


def draw(args: argparse.Namespace) -> Path:
    """The picture of ``args`` (see the module docstring); returns the file written."""
    import torch

    from lightning_mods.checkpointing.rebuild import load_run, read_torch_file
    from lightning_mods.evaluation._input_geometry import network_geometry
    from lightning_mods.pictures._patch_pca import images_for_display, patch_feature_figure, patch_rgb
    from lightning_mods.pictures.grids import figure_to_array, save_png

    if args.num_images < 1:
        raise ValueError(f"--num-images: must be >= 1, got {args.num_images}")
    if args.block == 0:
        raise ValueError("--block: 1 is the block nearest the input, -1 the last; 0 is none")
    from_split = args.images in ("val", "train")
    try:
        model, datamodule = load_run(args.ckpt_path, data=data_settings(args.data_set))
    except (ValueError, OSError):
        if from_split:
            raise
        # a folder of images: the datamodule (its data may live elsewhere) only gives the mean and std
        model, datamodule = load_run(args.ckpt_path, with_data=False)
    if not hasattr(model, "forward_patch_features"):
        raise ValueError(f"--ckpt_path: {type(model).__name__} has no patch features (forward_patch_features: the "
                         "MAE and the classifiers have them)")
    source = Path(args.images)
    if from_split:
        if datamodule is None:
            raise ValueError("--images: the checkpoint names no datamodule (it was not written by shortcutlab fit); "
                             "give a folder of images")
        datamodule.setup("fit")
        dataset = datamodule.val_dataset if args.images == "val" else datamodule.bank_dataset
        images = torch.stack([torch.as_tensor(dataset[i][0]) for i in range(min(args.num_images, len(dataset)))])
    elif source.is_dir():
        size, channels = network_geometry(model)
        channels = channels or 3
        mean = list(getattr(datamodule, "mean", None) or [0.5] * channels)
        std = list(getattr(datamodule, "std", None) or [0.5] * channels)
        size = int(size or getattr(datamodule, "image_size", 224))
        images = folder_images(source, args.num_images, channels, size, mean, std)
    else:
        raise FileNotFoundError(f"--images: '{args.images}' is neither val, train nor a folder")
    mean = getattr(datamodule, "mean", None) or [0.5] * images.shape[1]
    std = getattr(datamodule, "std", None) or [0.5] * images.shape[1]
    block = args.block - 1 if args.block > 0 else args.block
    model.eval()
    with torch.no_grad():
        try:
            features = model.forward_patch_features(images, block)
        except IndexError:
            raise ValueError(f"--block: {args.block} does not exist in this {type(model).__name__}") from None
    where = "the last block" if args.block == -1 else f"block {args.block}"
    step = read_torch_file(args.ckpt_path, "checkpoint", mmap=True).get("global_step", "?")
    title = (f"{type(model).__name__} patch features, {where}, step {step} of "
             f"{Path(args.ckpt_path).name}\ntop-3 principal components over these {len(images)} images as RGB")
    figure = patch_feature_figure(images_for_display(images, mean, std), patch_rgb(features.float()).numpy(), title)
    label = "last" if args.block == -1 else str(args.block)
    return save_png(figure_to_array(figure), Path(args.out) / f"patch_features_block{label}.png")


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        path = draw(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"shortcutlab features: error: {err}", file=sys.stderr)
        sys.exit(exit_statuses.BAD_INPUT)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
