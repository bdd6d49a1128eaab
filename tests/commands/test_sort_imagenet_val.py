"""shortcutlab sort-imagenet-val: the official validation folder (images in one folder) sorted into
the class folders ImageNet reads, from Kaggle's LOC_val_solution.csv or the ILSVRC2012 devkit's
ground truth and meta.mat (written here in their real formats); a missing image is one line with
nothing moved; a second run leaves a sorted folder as it is; the sorted folder loads."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from datamodules.imagenet import ImageNet

ROOT = Path(__file__).resolve().parents[2]
WNIDS = ["n01440764", "n01443537"]
CLASS_OF = [1, 0, 1, 0]  # image i + 1's class (index into WNIDS)


def official_val(tmp_path: Path) -> Path:
    val = tmp_path / "imagenet" / "val"
    val.mkdir(parents=True)
    for i in range(1, 5):
        Image.fromarray(np.full((40, 50, 3), 40 * i, dtype=np.uint8)).save(val / f"ILSVRC2012_val_{i:08d}.JPEG")
    for wnid in WNIDS:  # the train split the datamodule checks the classes against
        (tmp_path / "imagenet" / "train" / wnid).mkdir(parents=True)
        Image.fromarray(np.zeros((40, 50, 3), dtype=np.uint8)).save(tmp_path / "imagenet" / "train" / wnid / "a.JPEG")
    return val


def sort(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "sort-imagenet-val", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def expected_layout(val: Path) -> set[str]:
    return {f"{WNIDS[c]}/ILSVRC2012_val_{i:08d}.JPEG" for i, c in enumerate(CLASS_OF, start=1)}


def layout(val: Path) -> set[str]:
    return {str(p.relative_to(val)) for p in val.rglob("*.JPEG")}


def test_kaggle_labels_sort_the_folder_and_a_second_run_leaves_it(tmp_path):
    val = official_val(tmp_path)
    labels = tmp_path / "LOC_val_solution.csv"
    labels.write_text("ImageId,PredictionString\n" + "".join(
        f"ILSVRC2012_val_{i:08d},{WNIDS[c]} 1 2 30 40 {WNIDS[c]} 3 4 20 20\n" for i, c in enumerate(CLASS_OF, start=1)))
    done = sort(str(val), "--labels", str(labels))
    assert done.returncode == 0, done.stderr
    assert layout(val) == expected_layout(val) and "sorted 4 images into 2 class folders" in done.stdout
    again = sort(str(val), "--labels", str(labels))
    assert again.returncode == 0 and layout(val) == expected_layout(val)
    data = ImageNet(data_dir=str(tmp_path / "imagenet"), num_classes=2, num_workers=0, image_size=32)
    data.setup("validate")
    assert sorted(data.val_dataset[i][1] for i in range(len(data.val_dataset))) == [0, 0, 1, 1]


def test_devkit_ground_truth_and_meta_sort_the_folder(tmp_path):
    from scipy.io import savemat

    val = official_val(tmp_path)
    synsets = np.zeros(2, dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O")])
    for index, wnid in enumerate(WNIDS):  # ids 1 and 2, as the devkit numbers them
        synsets[index] = (index + 1, wnid)
    savemat(tmp_path / "meta.mat", {"synsets": synsets})
    (tmp_path / "ILSVRC2012_validation_ground_truth.txt").write_text("".join(f"{c + 1}\n" for c in CLASS_OF))
    done = sort(str(val), "--labels", str(tmp_path / "ILSVRC2012_validation_ground_truth.txt"),
                "--meta", str(tmp_path / "meta.mat"))
    assert done.returncode == 0, done.stderr
    assert layout(val) == expected_layout(val)


def test_an_image_missing_is_one_line_and_nothing_moves(tmp_path):
    val = official_val(tmp_path)
    (val / "ILSVRC2012_val_00000003.JPEG").unlink()
    labels = tmp_path / "LOC_val_solution.csv"
    labels.write_text("ImageId,PredictionString\n" + "".join(
        f"ILSVRC2012_val_{i:08d},{WNIDS[c]} 1 2 3 4\n" for i, c in enumerate(CLASS_OF, start=1)))
    before = layout(val)
    done = sort(str(val), "--labels", str(labels))
    assert done.returncode == 2 and layout(val) == before
    assert done.stderr.strip().splitlines() == [
        f"shortcutlab sort-imagenet-val: error: 'ILSVRC2012_val_00000003.JPEG' (class {WNIDS[1]}) is neither in "
        f"'{val}' nor in '{val / WNIDS[1]}'; nothing was moved"]
