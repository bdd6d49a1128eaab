"""Sort ImageNet's validation images into class folders, the layout ``datamodules.imagenet.ImageNet``
reads (``val/<wnid>/<image>``, as ``train/``).

    shortcutlab sort-imagenet-val data/imagenet/val --labels LOC_val_solution.csv

The official validation set comes as 50,000 images in one folder. ``--labels`` says which class
each is, in either form ImageNet hands out:

- ``LOC_val_solution.csv`` (the Kaggle ImageNet localisation challenge): ``ImageId,PredictionString``
  rows whose string starts with the image's wnid;
- ``ILSVRC2012_validation_ground_truth.txt`` of the ILSVRC2012 devkit (one ILSVRC2012 class id a
  line, in file-name order) with ``--meta`` the devkit's ``meta.mat`` (id -> wnid).

Every image named is moved into its class folder (``os.replace``: a move within the disk, no
copy). All images are checked first: one the labels name that is neither in the folder nor
already in its class folder stops the command in one line, with nothing moved. A folder already
sorted (in part or whole) is finished, not disturbed: running it twice is harmless.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import lightning_mods.exit_statuses as exit_statuses

IMAGE_SUFFIX = ".JPEG"


def labels_from_csv(path: Path) -> dict[str, str]:
    """``LOC_val_solution.csv`` -> ``{image file name: wnid}``."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"ImageId", "PredictionString"} <= set(rows[0]):
        raise ValueError(f"--labels: '{path}' is not LOC_val_solution.csv (expected ImageId,PredictionString rows)")
    return {row["ImageId"] + IMAGE_SUFFIX: row["PredictionString"].split()[0] for row in rows}


def labels_from_devkit(ground_truth: Path, meta: Path) -> dict[str, str]:
    """The devkit's ground truth (ILSVRC2012 ids in file order) and ``meta.mat`` -> ``{file: wnid}``."""
    from scipy.io import loadmat

    synsets = loadmat(str(meta), squeeze_me=True)["synsets"]
    wnid_of = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets}
    ids = [int(line) for line in ground_truth.read_text().split()]
    try:
        return {f"ILSVRC2012_val_{i:08d}{IMAGE_SUFFIX}": wnid_of[class_id] for i, class_id in enumerate(ids, start=1)}
    except KeyError as err:
        raise ValueError(f"--labels: class id {err.args[0]} of '{ground_truth}' is not in '{meta}'") from None


def plan_moves(val_dir: Path, labels: dict[str, str]) -> list[tuple[Path, Path]]:
    """``(source, destination)`` of every image still to move; a ValueError naming the first image
    that is nowhere to be found."""
    moves = []
    for name, wnid in sorted(labels.items()):
        source, destination = val_dir / name, val_dir / wnid / name
        if destination.is_file():
            continue  # sorted before
        if not source.is_file():
            raise ValueError(f"'{name}' (class {wnid}) is neither in '{val_dir}' nor in '{val_dir / wnid}'; "
                             "nothing was moved")
        moves.append((source, destination))
    return moves


def sort_val(val_dir: Path, labels: dict[str, str]) -> int:
    """Move the images into their class folders; the number moved."""
    moves = plan_moves(val_dir, labels)
    for source, destination in moves:
        destination.parent.mkdir(exist_ok=True)
        os.replace(source, destination)
    return len(moves)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shortcutlab sort-imagenet-val", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("val_dir", type=Path, help="the folder of the 50,000 validation images")
    parser.add_argument("--labels", type=Path, required=True,
                        help="LOC_val_solution.csv, or the devkit's ILSVRC2012_validation_ground_truth.txt (with --meta)")
    parser.add_argument("--meta", type=Path, default=None, help="the devkit's meta.mat (with its ground truth file)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        for path in [args.val_dir, args.labels, *([args.meta] if args.meta else [])]:
            if not path.exists():
                raise FileNotFoundError(f"no such file or folder: '{path}'")
        labels = labels_from_devkit(args.labels, args.meta) if args.meta else labels_from_csv(args.labels)
        moved = sort_val(args.val_dir, labels)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"shortcutlab sort-imagenet-val: error: {err}", file=sys.stderr)
        sys.exit(exit_statuses.BAD_INPUT)
    print(f"sorted {moved} images into {len(set(labels.values()))} class folders under {args.val_dir}"
          + (f" ({len(labels) - moved} were in place already)" if moved < len(labels) else ""))
    return 0


if __name__ == "__main__":
    main()
