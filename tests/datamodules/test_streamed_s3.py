"""ImageNet converted straight to object storage and trained from it, against a real S3 server the
tests start (moto's, over HTTPS: helpers/s3_server.py): the conversion holds the ImageFolder's
samples; an epoch fetches each chunk once (bytes and requests counted by the server); a fit at 2
processes sees every sample once an epoch and resumes mid-epoch exactly; a bad bucket, missing
credentials and a truncated chunk are one line each."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
from pathlib import Path

import pytest

from commands import chunks
from conftest import IMAGENET_TEST_CLASSES, make_imagefolder
from datamodules.chunk_order import ChunkOrder
from datamodules.imagenet import ImageNet
from datamodules.streamed_images import StreamedSplit, read_conversion
from helpers import folders
from benchmarks.s3_server import S3Server

# litdata 0.2.76's reader drops a chunk's file object without closing it when it moves to the next
# chunk (PyTreeLoader._close_open_chunk); CPython closes it at once, with a ResourceWarning
pytestmark = pytest.mark.filterwarnings("ignore:unclosed file <_io.FileIO name=.*chunk-.*:ResourceWarning")
REPO = Path(__file__).resolve().parents[2]
BUCKET = "conversions"
URI = f"s3://{BUCKET}/imagenet"
SMALL = ["--num_workers", "1", "--chunk_bytes", "8KB", "--no_progress"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    before = dict(os.environ)
    os.environ.update(server.environment())
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    os.environ.clear()
    os.environ.update(before)
    server.stop()


@pytest.fixture(scope="module")
def trees(server, warm_shortcutlab, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trees")
    make_imagefolder(root / "folder", IMAGENET_TEST_CLASSES, n_per_class=5)
    convert(warm_shortcutlab, root / "folder", URI)
    chunks.main([str(root / "folder"), str(root / "local"), *SMALL])
    return {"folder": root / "folder", "local": root / "local"}


def convert(warm: list[str], source: Path, dest: str, *extra: str, status: int = 0) -> subprocess.CompletedProcess:
    """``shortcutlab chunks`` in its own process (a warm fork: litdata's uploads leave asyncio loops
    to the interpreter's end)."""
    done = subprocess.run([*warm, "chunks", str(source), dest, *SMALL, *extra], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.returncode == status, done.stderr[-3000:]
    return done


def folder_samples(folder: Path, split: str) -> list[tuple[bytes, int]]:
    return [(path.read_bytes(), label) for label, name in enumerate(IMAGENET_TEST_CLASSES)
            for path in sorted((folder / split / name).iterdir())]


def in_folder_order(split: StreamedSplit) -> list[tuple[bytes, int]]:
    """The split's samples put in ImageFolder order (from object storage they are numbered as stored)."""
    stored = [(source.data, label) for source, label in (split[i] for i in range(len(split)))]
    return [stored[position] for position in sorted(range(len(stored)), key=split.conversion.source_index)]


def test_a_conversion_written_to_object_storage_holds_the_image_folder_s_samples(server, trees, tmp_path,
                                                                                 warm_shortcutlab):
    for split in ("train", "val"):
        stream = StreamedSplit(read_conversion(f"{URI}/{split}", str(tmp_path)), str(tmp_path))
        assert in_folder_order(stream) == folder_samples(trees["folder"], split)
        stored = [stream[i][1] for i in range(len(stream))]
        assert stored != sorted(stored)  # numbered as stored: each chunk mixes the classes
    keys = {o["Key"] for o in server.client().list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert {"imagenet/train/index.json", "imagenet/val/index.json"} <= keys
    assert not any(".checkpoints" in key for key in keys)  # litdata's resume state goes once finished
    assert "train: already converted (20 images in" in convert(warm_shortcutlab, trees["folder"], URI).stdout


def chunk_of(position: int, sizes: list[int]) -> int:
    for chunk, end in enumerate(itertools.accumulate(sizes)):
        if position < end:
            return chunk
    raise AssertionError(position)


def test_the_chunk_order_reads_every_sample_once_chunk_by_chunk_in_an_order_seeded_by_the_epoch():
    sizes = [3, 5, 2, 4, 6]  # 20 samples stored at positions 0..19
    orders = {}
    for epoch in (0, 1):
        ranks = []
        for rank in range(2):
            sampler = ChunkOrder(sizes, index_of=lambda position: 100 + position, num_replicas=2, rank=rank, seed=3)
            sampler.set_epoch(epoch)
            ranks.append(list(sampler))
            assert list(sampler) == ranks[-1] and len(sampler) == 10
        assert sorted(ranks[0] + ranks[1]) == list(range(100, 120))  # each once, across the ranks
        for order in ranks:  # each chunk read in one run: no chunk comes back within a rank's epoch
            runs = [chunk_of(i - 100, sizes) for i in order]
            changes = [a for a, b in zip(runs, runs[1:]) if a != b] + [runs[-1]]
            assert len(changes) == len(set(changes)), runs
        orders[epoch] = ranks
    assert orders[0] != orders[1]
    odd = ChunkOrder([3, 4], index_of=int, num_replicas=2, rank=1)
    assert len(odd) == 4 and len(set(list(odd) + list(ChunkOrder([3, 4], index_of=int, num_replicas=2)))) == 7


def one_epoch(server: S3Server, cache: Path, num_workers: int, **options) -> list[tuple[str, int]]:
    """``(path, bytes)`` of every train chunk the server sent for one epoch of a fresh cache."""
    data = ImageNet(data_dir=URI, num_classes=4, batch_size=2, image_size=8, num_workers=num_workers,
                    persistent_workers=False, train_augmentation=False, cache_dir=str(cache), **options)
    data.setup("fit")
    loader = data.train_dataloader()
    server.served.reset()
    assert sum(len(labels) for _, labels in loader) == 20
    return server.served.gets(f"/{BUCKET}/imagenet/train/chunk-")


@pytest.mark.parametrize("workers, cache", [(2, "100GB"), (0, "14KB")])
def test_an_epoch_from_object_storage_fetches_each_chunk_once(server, trees, tmp_path, workers, cache):
    """Two loader workers sharing the cache, or one reader with a cache of two chunks (litdata
    deletes a chunk once read): every train chunk is fetched once, the bytes served are at most
    1.1x the split's chunks, and the requests are of the order of its chunks, not its samples."""
    index = json.loads((trees["local"] / "train" / "index.json").read_text())
    size = sum(c["chunk_bytes"] for c in index["chunks"])
    server.served.reset()
    fetched = one_epoch(server, tmp_path / "cache", workers, max_cache_size=cache)
    assert sorted(path for path, _ in fetched) == sorted(f"/{BUCKET}/imagenet/train/{c['filename']}"
                                                          for c in index["chunks"])
    assert sum(size for _, size in fetched) <= 1.1 * size
    assert len(server.served.gets(f"/{BUCKET}/")) <= len(index["chunks"]) + 4 < 20


def test_an_evaluation_pass_from_object_storage_fetches_each_chunk_once(server, trees, tmp_path):
    """The validation and bank loaders, in index order, with a cache of two chunks."""
    data = ImageNet(data_dir=URI, num_classes=4, batch_size=2, image_size=8, num_workers=0,
                    cache_dir=str(tmp_path / "cache"), max_cache_size="14KB")
    data.setup("fit")
    for split, loader in (("val", data.val_dataloader()), ("train", data.bank_dataloader())):
        server.served.reset()
        assert sum(len(labels) for _, labels in loader) == 20
        index = json.loads((trees["local"] / split / "index.json").read_text())
        assert sorted(path for path, _ in server.served.gets(f"/{BUCKET}/imagenet/{split}/chunk-")) == \
            sorted(f"/{BUCKET}/imagenet/{split}/{c['filename']}" for c in index["chunks"])


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_a_fit_from_object_storage_resumes_exactly_and_fetches_each_chunk_once(server, trees, tmp_path, devices,
                                                                              warm_shortcutlab, monkeypatch):
    """Two epochs, a mid-epoch checkpoint and the fit resumed from it, every process sharing one
    cache that holds the split: each sample once an epoch across the ranks, the resumed fit's
    batches exactly the uninterrupted fit's after the checkpoint, each train chunk fetched once."""
    from test_streamed_resume import SCRIPT, batches, run

    script = tmp_path / "fit.py"
    script.write_text(SCRIPT.format(tests=folders.PATHS))
    monkeypatch.setenv("TEST_CHUNK_CACHE", str(tmp_path / "cache"))
    server.served.reset()
    run(script, URI, tmp_path / "run", devices, warm_shortcutlab)
    fetched = [path for path, _ in server.served.gets(f"/{BUCKET}/imagenet/train/chunk-")]
    index = json.loads((trees["local"] / "train" / "index.json").read_text())
    assert sorted(fetched) == sorted(f"/{BUCKET}/imagenet/train/{c['filename']}" for c in index["chunks"])
    full = batches(tmp_path / "run", "full", devices)
    everything = sorted(json.loads((tmp_path / "run" / "bank.json").read_text()))
    assert len(everything) == 20 == len(set(everything))  # the pixel sums name the samples
    for epoch in (0, 1):
        assert sorted(i for e, _, _, ids in full if e == epoch for i in ids) == everything
    steps = 20 // (2 * devices)
    saved = (7 // steps, 7 % steps)  # the batch after the checkpoint at step 7: mid-epoch
    assert saved[1] != 0
    assert batches(tmp_path / "run", "resumed", devices) == [b for b in full if (b[0], b[1]) >= saved]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_a_bad_bucket_and_missing_credentials_are_one_line_each(server, trees, monkeypatch, warm_shortcutlab):
    bad = convert(warm_shortcutlab, trees["folder"], "s3://no-such-bucket/imagenet", status=2)
    assert last_line(bad.stderr) == bad.stderr.strip()
    assert "chunks: cannot write to 's3://no-such-bucket/imagenet/train' (NoSuchBucket" in bad.stderr
    with pytest.raises(FileNotFoundError) as caught:
        ImageNet(data_dir="s3://no-such-bucket/imagenet", num_classes=4).check_files()
    assert str(caught.value).startswith("ImageNet: cannot read the conversion at 's3://no-such-bucket/imagenet/train'")
    assert "\n" not in str(caught.value)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance to ask for credentials either
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(REPO / "no-such-file"))
    anonymous = convert(warm_shortcutlab, trees["folder"], f"s3://{BUCKET}/other", status=2)
    assert last_line(anonymous.stderr) == anonymous.stderr.strip()
    assert f"cannot write to 's3://{BUCKET}/other/train' (NoCredentialsError: Unable to locate credentials)" \
        in anonymous.stderr
    with pytest.raises(FileNotFoundError, match="cannot read the conversion at .* locate credentials"):
        ImageNet(data_dir=URI, num_classes=4).check_files()


@pytest.mark.slow
def test_a_truncated_chunk_in_object_storage_stops_a_fit_in_one_line(server, trees, tmp_path, warm_shortcutlab):
    from test_cli import TINY_MAE

    client = server.client()
    for item in client.list_objects_v2(Bucket=BUCKET, Prefix="imagenet/")["Contents"]:
        client.copy_object(Bucket=BUCKET, Key=item["Key"].replace("imagenet/", "truncated/", 1),
                           CopySource={"Bucket": BUCKET, "Key": item["Key"]})
    key = f"truncated/train/{json.loads((trees['local'] / 'train' / 'index.json').read_text())['chunks'][1]['filename']}"
    whole = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    client.put_object(Bucket=BUCKET, Key=key, Body=whole[: len(whole) // 2])
    env = dict(os.environ, PYTHONPATH=str(REPO), MAX_WAIT_TIME="3")  # litdata's wait for a chunk (read when
    # litdata is imported: the warm CLI has not imported it)
    fit = subprocess.run([*warm_shortcutlab, "fit", *TINY_MAE, "--data=datamodules.imagenet.ImageNet",
                          f"--data.init_args.data_dir=s3://{BUCKET}/truncated", "--data.init_args.num_classes=4",
                          "--data.init_args.image_size=16", "--data.init_args.batch_size=4",
                          "--data.init_args.num_workers=0", f"--data.init_args.cache_dir={tmp_path / 'cache'}",
                          "--trainer.max_epochs=1", "--trainer.accelerator=cpu", "--trainer.logger=false",
                          "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert fit.returncode != 0
    assert last_line(fit.stderr) == (f"shortcutlab: error: ImageNet: chunk 's3://{BUCKET}/truncated/train/"
                                     f"{key.rsplit('/', 1)[1]}' is truncated ({len(whole) // 2} of {len(whole)} bytes); "
                                     "convert again (`shortcutlab chunks`) or copy the conversion again"), fit.stderr[-3000:]


def test_storage_options_name_the_store_without_the_environment(server, trees, tmp_path, monkeypatch,
                                                               warm_shortcutlab):
    """litdata's ``storage_options`` (boto3's client arguments) given to the command and to the
    datamodule reach the store when the environment names no endpoint."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    options = {"endpoint_url": server.endpoint}
    convert(warm_shortcutlab, trees["folder"], f"s3://{BUCKET}/with-options", "--storage_options", json.dumps(options))
    data = ImageNet(data_dir=f"s3://{BUCKET}/with-options", num_classes=4, image_size=8, train_augmentation=False,
                    cache_dir=str(tmp_path / "cache"), storage_options=options)
    data.setup("fit")
    assert in_folder_order(data.val_dataset.samples.samples) == folder_samples(trees["folder"], "val")
