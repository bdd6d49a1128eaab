"""ImageNet converted to chunks (commands/chunks.py) and read back (datamodules/streamed_images.py):
the conversion keeps every file's bytes and label, in order (checked against the files); a second
run does nothing and an interrupted one finishes with the uninterrupted conversion; the datamodule
gives the ImageFolder's samples, pixels, batches and sample counts from it on every decode path;
bad conversions are one line each."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from commands import chunks
from datamodules.imagenet import ImageNet
from datamodules.streamed_images import StreamedSplit, read_conversion
from conftest import IMAGENET_TEST_CLASSES, make_class_list, make_imagefolder
from helpers import folders

REPO = Path(__file__).resolve().parents[2]

SMALL = ["--num_workers", "1", "--chunk_bytes", "8KB", "--no_progress"]


def convert(source: Path, dest: Path, *extra: str) -> None:
    chunks.main([str(source), str(dest), *SMALL, *extra])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imagefolder")
    make_imagefolder(root, IMAGENET_TEST_CLASSES, n_per_class=5)  # image 0 of a class a PNG, the rest JPEGs
    return root


@pytest.fixture(scope="module")
def converted(folder, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("chunks") / "imagenet"
    convert(folder, dest, "--num_workers", "2")  # two processes: the parts in any order, the index in order
    return dest


def files_in_order(folder: Path, split: str, classes: list[str]) -> list[tuple[Path, int]]:
    return [(path, label) for label, name in enumerate(classes) for path in sorted((folder / split / name).iterdir())]


def stored(dest: Path, split: str) -> list[tuple[bytes, int]]:
    samples = StreamedSplit(read_conversion(str(dest / split)))
    return [(source.data, label) for source, label in (samples[i] for i in range(len(samples)))]


@pytest.mark.parametrize("split", ["train", "val"])
def test_every_file_s_bytes_and_label_in_order(folder, converted, split):
    expected = [(path.read_bytes(), label) for path, label in files_in_order(folder, split, IMAGENET_TEST_CLASSES)]
    assert stored(converted, split) == expected
    index = json.loads((converted / split / "index.json").read_text())
    assert index["shortcutlab"]["classes"] == IMAGENET_TEST_CLASSES and len(index["chunks"]) > 2


def test_a_conversion_written_before_the_command_was_chunks_still_reads(folder, converted, tmp_path):
    """Its index names the format "shortcutlab-shards/1" (the same layout); any other format is refused."""
    for name, fmt in (("earlier", "shortcutlab-shards/1"), ("unknown", "shortcutlab-chunks/2")):
        copy = tmp_path / name
        shutil.copytree(converted, copy)
        for split in ("train", "val"):
            index = json.loads((copy / split / "index.json").read_text())
            assert index["shortcutlab"]["format"] == "shortcutlab-chunks/1"
            index["shortcutlab"]["format"] = fmt
            (copy / split / "index.json").write_text(json.dumps(index))
        if name == "earlier":
            assert stored(copy, "train") == stored(converted, "train")
        else:
            with pytest.raises(ValueError, match="is not a conversion of `shortcutlab chunks`"):
                read_conversion(str(copy / "train"))


def test_a_one_worker_conversion_leaves_the_calling_process_environment_as_it_was(folder, tmp_path, monkeypatch):
    """litdata's optimizer sets its variables in the calling process (its rank, which its
    StreamingDataset reads later in that process): the command puts the environment back."""
    monkeypatch.delenv("DATA_OPTIMIZER_GLOBAL_RANK", raising=False)
    convert(folder, tmp_path / "one")
    assert "DATA_OPTIMIZER_GLOBAL_RANK" not in os.environ
    monkeypatch.setenv("DATA_OPTIMIZER_GLOBAL_RANK", "7")
    convert(folder, tmp_path / "two")
    assert os.environ["DATA_OPTIMIZER_GLOBAL_RANK"] == "7"
    assert stored(tmp_path / "one", "train") == stored(tmp_path / "two", "train")


def test_a_finished_conversion_says_so_and_does_nothing(folder, converted, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in (converted / "train").iterdir()}
    convert(folder, converted)
    assert "train: already converted (20 images in" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in (converted / "train").iterdir()} == before


KILLED_AT = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = {paths!r}
    from commands import chunks
    read = chunks.ReadSample.__call__

    def killed_at_position_12(self, position):  # litdata's worker, mid-split: the whole job dies
        if position == 12:
            os.killpg(0, signal.SIGKILL)
        return read(self, position)

    chunks.ReadSample.__call__ = killed_at_position_12
    chunks.main(sys.argv[1:])
""")


def test_an_interrupted_conversion_resumes_to_the_uninterrupted_one(folder, converted, tmp_path, capsys):
    """A conversion killed mid-split (every process at once) and run again finishes from litdata's
    checkpoints with the uninterrupted conversion's samples."""
    dest, script = tmp_path / "resumed", tmp_path / "killed.py"
    script.write_text(KILLED_AT.format(paths=[str(REPO), *folders.PATHS]))
    killed = subprocess.run([sys.executable, str(script), str(folder), str(dest), *SMALL], cwd=REPO,
                            start_new_session=True, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (dest / "train" / "index.json").exists() and list((dest / "train").glob("chunk-*.bin"))
    convert(folder, dest)
    out = capsys.readouterr().out
    assert "train: 20 images in" in out and "resumed from an interrupted run" in out, out
    for split in ("train", "val"):
        assert stored(dest, split) == stored(converted, split)
    assert not (dest / "train" / ".checkpoints").exists()


def eval_samples(data: ImageNet, which: str) -> list[tuple[torch.Tensor, int]]:
    dataset = getattr(data, which)
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize("decoder", ["torchvision", "pil"])
def test_the_datamodule_gives_the_image_folder_s_samples(folder, converted, decoder):
    settings = dict(num_classes=4, batch_size=4, image_size=16, eval_crop_ratio=0.8, num_workers=0, decoder=decoder)
    plain, streamed = ImageNet(data_dir=str(folder), **settings), ImageNet(data_dir=str(converted), **settings)
    for data in (plain, streamed):
        data.setup("fit")
    assert streamed.streamed and not plain.streamed
    for which in ("val_dataset", "bank_dataset"):
        expected, got = eval_samples(plain, which), eval_samples(streamed, which)
        assert len(got) == len(expected) == 20
        for (a, y), (b, z) in zip(expected, got):
            assert torch.equal(a, b) and y == z
    assert len(streamed.train_dataset) == len(plain.train_dataset) == 20


@pytest.mark.parametrize("decoder", ["torchvision", "gpu"])
def test_the_same_training_batches_on_both_decode_paths(folder, converted, decoder):
    """The loader's order and the workers' augmentation draws are the ImageFolder's: equal batches."""
    batches = []
    for root in (folder, converted):
        data = ImageNet(data_dir=str(root), num_classes=4, batch_size=4, image_size=16, num_workers=2, decoder=decoder,
                        persistent_workers=False)
        data.setup("fit")
        loader = data.train_dataloader()
        batches.append([data.transfer_batch_to_device(b, torch.device("cpu"), 0) for b in loader])
    assert len(batches[0]) == len(batches[1]) == 5
    for (a, y), (b, z) in zip(*batches):
        assert torch.equal(a, b) and torch.equal(y, z)


def test_a_class_list_conversion_and_the_settings_it_must_agree_with(folder, tmp_path):
    subset = make_class_list(tmp_path / "subset.txt", ["n01484850", "n01440764"])
    dest = tmp_path / "subset"
    convert(folder, dest, "--class_list", str(subset))
    data = ImageNet(data_dir=str(dest), class_list=str(subset), batch_size=2, image_size=16, num_workers=0)
    data.setup("fit")
    assert data.num_classes == 2 and len(data.bank_dataset) == 10 and data.classes == ["n01484850", "n01440764"]
    other = make_class_list(tmp_path / "other.txt", ["n01440764", "n01484850"])
    with pytest.raises(ValueError, match=r"^ImageNet: the conversion at '.*' holds the same classes in another order, "
                                         r"class_list '.*other.txt' names 2; convert with that class list"):
        ImageNet(data_dir=str(dest), class_list=str(other)).check_files()
    with pytest.raises(ValueError, match=r"^ImageNet: num_classes=1000 but the conversion at '.*' holds 2 classes"):
        ImageNet(data_dir=str(dest)).check_files()


def test_bad_conversions_are_one_line_each(converted, tmp_path, monkeypatch):
    def check(root) -> str:  # noqa: ANN001 (a folder or a URI)
        with pytest.raises((ValueError, FileNotFoundError)) as caught:
            ImageNet(data_dir=str(root), num_classes=4).check_files()
        assert "\n" not in str(caught.value)
        return str(caught.value)

    broken = tmp_path / "copy"
    shutil.copytree(converted, broken)
    chunk = broken / "train" / json.loads((broken / "train" / "index.json").read_text())["chunks"][1]["filename"]
    chunk.write_bytes(chunk.read_bytes()[:100])
    assert check(broken) == f"ImageNet: chunk '{chunk}' is truncated (100 of {os.path.getsize(converted / 'train' / chunk.name)} " \
                            "bytes); convert again (`shortcutlab chunks`) or copy the conversion again"
    foreign = tmp_path / "foreign"
    shutil.copytree(converted, foreign)
    index = json.loads((foreign / "train" / "index.json").read_text())
    (foreign / "train" / "index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "shortcutlab"}))
    assert "holds litdata chunks but is not a conversion of `shortcutlab chunks`" in check(foreign)
    unfinished = tmp_path / "unfinished"
    shutil.copytree(converted, unfinished)
    (unfinished / "val" / "index.json").unlink()
    assert check(unfinished).endswith("is an unfinished conversion (no index.json); run `shortcutlab chunks SOURCE "
                                      "DEST` again to finish it")
    monkeypatch.setattr("datamodules.streamed_images.REACH_SECONDS", 3.0)
    for name, value in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
                        "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}.items():  # nothing listens on port 9
        monkeypatch.setenv(name, value)
    message = check("s3://shortcutlab-nowhere/imagenet")
    assert message.startswith("ImageNet: cannot read the conversion at 's3://shortcutlab-nowhere/imagenet/train' (")


def other_litdata_dataset(dest: Path) -> Path:
    """A litdata dataset of 20 samples (as many as a split of the tree) that is not a conversion."""
    import litdata

    litdata.optimize(fn=lambda i: {"value": i}, inputs=list(range(20)), output_dir=str(dest / "train"),
                     chunk_bytes="1KB", num_workers=1, verbose=False, start_method="fork")
    return dest


def test_the_command_s_own_bad_input_is_one_line_and_status_2(folder, converted, tmp_path, capsys):
    for args, message in [
        ([str(tmp_path / "absent"), str(tmp_path / "d")], "has no train/ and val/ class folders"),
        ([str(folder), str(converted), "--class_list", str(make_class_list(tmp_path / "two.txt", IMAGENET_TEST_CLASSES[:2]))],
         "is already a conversion of 4 classes and 20 images, the source has 2 and 10; choose another DEST"),
        ([str(folder), str(tmp_path / "d"), "--class_list", str(make_class_list(tmp_path / "x.txt", ["n9"]))],
         "chunks: class 'n9' has no folder under"),
        ([str(folder), str(other_litdata_dataset(tmp_path / "other"))], "already holds another litdata dataset"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            chunks.main([*args, *SMALL])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and "\n" not in err and err.startswith("shortcutlab: error: chunks: "), err
        assert message in err, err


def test_an_image_that_cannot_be_read_while_converting_is_one_line_and_leaves_no_finished_split(folder, tmp_path,
                                                                                               capsys):
    """litdata's worker meets a file it cannot read (here a folder named like an image): the
    command says which in one line, status 2, and the split has no index (nothing finished)."""
    tree = tmp_path / "tree"
    shutil.copytree(folder, tree)
    broken = sorted((tree / "train" / IMAGENET_TEST_CLASSES[1]).iterdir())[2]
    broken.unlink()
    broken.mkdir()
    with pytest.raises(SystemExit) as exit_info:
        convert(tree, tmp_path / "dest", "--num_workers", "2")
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err, err
    assert err.startswith(f"shortcutlab: error: chunks: cannot read '{broken}' (Is a directory); 1 image(s) not "
                          "converted, nothing finished"), err
    assert not (tmp_path / "dest" / "train" / "index.json").exists()


def test_a_ddp_fit_of_a_conversion_of_other_classes_stops_in_one_line_before_it_starts(converted, tmp_path,
                                                                                      monkeypatch, capsys):
    """configs/data/imagenet100.yaml's class list (100 classes) against a 4-class conversion: one line
    from the launching process, exit status 2, no run folder."""
    from test_bad_input import imagenet100_ddp_fit

    code, lines = imagenet100_ddp_fit(monkeypatch, capsys, converted, tmp_path / "run")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (f"shortcutlab: error: ImageNet: the conversion at '{converted}' holds 4 classes, class_list "
                        "'configs/imagenet100_classes.txt' names 100; convert with that class list (shortcutlab chunks "
                        "--class_list) or use the conversion's")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_fit_from_the_conversion_equals_the_fit_from_the_folder(folder, converted, tmp_path, warm_shortcutlab):
    """``shortcutlab fit`` with a kNN evaluation and the online probe, once on the tree and once on its
    conversion: the same sample counts in every pass and the same logged numbers."""
    from test_bad_input import shortcutlab
    from test_cli import TINY_MAE

    runs = {}
    for name, data_dir in (("folder", folder), ("chunks", converted)):
        out = shortcutlab(warm_shortcutlab, "fit", "--seed_everything=0", *TINY_MAE, "--data=datamodules.imagenet.ImageNet",
                          f"--data.init_args.data_dir={data_dir}", "--data.init_args.num_classes=4",
                          "--data.init_args.image_size=16", "--data.init_args.batch_size=4",
                          "--data.init_args.num_workers=0", "--trainer.max_epochs=2", "--trainer.accelerator=cpu",
                          "--trainer.enable_progress_bar=false", "--trainer.logger=CSVLogger",
                          f"--trainer.logger.save_dir={tmp_path / name}",
                          "--trainer.callbacks+=callbacks.measurement.knn.KNNEvaluator", "--trainer.callbacks.k=5",
                          "--trainer.callbacks+=callbacks.measurement.online_probe.OnlineLinearProbe",
                          "--trainer.callbacks.every_n_steps=1", f"--trainer.default_root_dir={tmp_path / name}")
        assert out.returncode == 0, out.stderr[-3000:]
        passes = [line.split(" in ")[0] for line in out.stdout.splitlines() if " images in " in line]
        metrics = (tmp_path / name / "lightning_logs" / "version_0" / "metrics.csv").read_text()
        runs[name] = passes, metrics
    passes, metrics = runs["chunks"]
    assert {"KNNEvaluator: bank_dataset, 20 images", "KNNEvaluator: val_dataset, 20 images"} == set(passes)  # shared
    assert runs["folder"] == runs["chunks"]
    assert "knn/top1" in metrics and "online_probe/val_top1" in metrics
