"""Datamodules on generated files in the real on-disk formats (the decay paper, section 4, data).

References are computed here from the generated pixels (or scikit-learn's raw digits) by hand,
never by the datamodule's own code.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from conftest import IMAGENET_TEST_CLASSES, IMAGENET_TEST_SUBSET, make_cifar10, make_class_list, make_imagefolder
from datamodules import CIFAR10, CIFAR100, MNIST, Digits, ImageNet

DIGITS_MEAN, DIGITS_STD = 0.3054, 0.3761


def normalise(pixels_hwc: np.ndarray, mean, std, max_value: float = 255.0) -> torch.Tensor:
    """uint8 H x W (x C) pixels -> the C x H x W tensor the eval transform must give."""
    x = pixels_hwc.astype(np.float64) / max_value
    x = x[..., None] if x.ndim == 2 else x
    x = (x - np.asarray(mean)) / np.asarray(std)
    return torch.from_numpy(x.transpose(2, 0, 1)).float()


def one_batch(loader):
    images, labels = next(iter(loader))
    assert images.dtype == torch.float32 and labels.dtype == torch.int64
    assert images.ndim == 4 and labels.shape == (images.shape[0],)
    return images, labels


def check_every_loader(dm, channels: int, size: int, num_classes: int) -> None:
    dm.setup("fit")
    dm.setup("test")
    dm.setup("predict")
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader(),
                   dm.predict_dataloader(), dm.bank_dataloader()):
        images, labels = one_batch(loader)
        assert images.shape[1:] == (channels, size, size)
        assert 0 <= labels.min() and labels.max() < num_classes
        assert torch.isfinite(images).all()


# --- Digits -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sklearn_digits():
    digits = load_digits()
    train_idx, test_idx = train_test_split(np.arange(1797), test_size=0.2, stratify=digits.target, random_state=0)
    return digits, train_idx, test_idx


@pytest.fixture(scope="module")
def digits_fit():
    dm = Digits()
    dm.setup("fit")
    return dm


def test_digits_attributes_known_at_init():
    dm = Digits(batch_size=16)
    assert (dm.num_classes, dm.in_chans, dm.image_size, dm.batch_size, dm.num_workers) == (10, 1, 32, 16, 0)
    assert dm.mean == (DIGITS_MEAN,) and dm.std == (DIGITS_STD,)
    assert dm.horizontal_flip is False
    assert dm.hparams["batch_size"] == 16


def test_digits_split_sizes_stratified_and_fixed(digits_fit, sklearn_digits):
    digits, train_idx, test_idx = sklearn_digits
    assert len(digits_fit.train_dataset) == len(digits_fit.bank_dataset) == 1437
    assert len(digits_fit.val_dataset) == 360
    train_counts = np.bincount(digits_fit.bank_dataset.labels.numpy(), minlength=10)
    val_counts = np.bincount(digits_fit.val_dataset.labels.numpy(), minlength=10)
    totals = np.bincount(digits.target, minlength=10)
    assert (train_counts + val_counts == totals).all()
    assert (np.abs(val_counts - 0.2 * totals) <= 1).all() and val_counts.min() > 0
    assert (digits_fit.val_dataset.labels.numpy() == digits.target[test_idx]).all()
    again = Digits()
    again.setup("fit")
    assert torch.equal(again.bank_dataset.images, digits_fit.bank_dataset.images)
    assert torch.equal(again.val_dataset.labels, digits_fit.val_dataset.labels)


def test_digits_stats_are_the_train_split_pixel_stats(sklearn_digits):
    digits, train_idx, _ = sklearn_digits
    pixels = digits.images[train_idx] / 16.0
    assert abs(pixels.mean() - DIGITS_MEAN) < 1e-4 and abs(pixels.std() - DIGITS_STD) < 1e-4


def test_digits_native_size_values_equal_raw_over_16_normalised(sklearn_digits):
    digits, train_idx, test_idx = sklearn_digits
    dm = Digits(image_size=8)
    dm.setup("fit")
    for dataset, idx in ((dm.val_dataset, test_idx), (dm.bank_dataset, train_idx)):
        expected = (digits.images[idx] / 16.0 - DIGITS_MEAN) / DIGITS_STD
        images = torch.stack([dataset[i][0] for i in range(len(dataset))])
        assert images.shape == (len(idx), 1, 8, 8)
        torch.testing.assert_close(images[:, 0], torch.from_numpy(expected).float(), rtol=0, atol=1e-6)


def test_digits_resize_is_bilinear_like_pil(digits_fit, sklearn_digits):
    digits, _, test_idx = sklearn_digits
    for i in (0, 1, 359):
        raw = (digits.images[test_idx[i]] / 16.0).astype(np.float32)
        resized = np.asarray(Image.fromarray(raw, mode="F").resize((32, 32), Image.BILINEAR))
        expected = torch.from_numpy((resized - DIGITS_MEAN) / DIGITS_STD)
        image, label = digits_fit.val_dataset[i]
        assert label == digits.target[test_idx[i]]
        torch.testing.assert_close(image[0], expected.float(), rtol=0, atol=1e-5)


def test_digits_loaders(digits_fit):
    check_every_loader(digits_fit, channels=1, size=32, num_classes=10)
    assert len(digits_fit.train_dataloader()) == 1437 // 128  # last incomplete batch dropped
    assert len(digits_fit.val_dataloader()) == -(-360 // 128)


def test_digits_augmentation_crops_but_does_not_flip_by_default():
    torch.manual_seed(0)
    whole_crop = Digits(crop_scale=(1.0, 1.0))  # the full image, unflipped: the eval image itself
    whole_crop.setup("fit")
    for i in range(20):
        assert torch.equal(whole_crop.train_dataset[i][0], whole_crop.bank_dataset[i][0])
    flipping = Digits(crop_scale=(1.0, 1.0), horizontal_flip=True)
    flipping.setup("fit")
    flipped = 0
    for i in range(40):
        image, plain = flipping.train_dataset[i][0], flipping.bank_dataset[i][0]
        flipped += int(torch.equal(image, plain.flip(-1)) and not torch.equal(image, plain))
        assert torch.equal(image, plain) or torch.equal(image, plain.flip(-1))
    assert 5 < flipped < 35
    cropping = Digits()
    cropping.setup("fit")
    changed = sum(not torch.allclose(cropping.train_dataset[i][0], cropping.bank_dataset[i][0]) for i in range(10))
    assert changed >= 8


# --- CIFAR-10 / CIFAR-100 ------------------------------------------------------------------
def test_generated_cifar10_reads_back_with_torchvision(tmp_path, monkeypatch):
    written = make_cifar10(tmp_path)
    # torchvision also checks the md5 sums of the official files, which generated files cannot match.
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args, **kwargs: True)
    for split, train in (("train", True), ("test", False)):
        reference = torchvision.datasets.CIFAR10(str(tmp_path), train=train)
        assert np.array_equal(reference.data, written[f"{split}_images"])
        assert reference.targets == written[f"{split}_labels"].tolist()


@pytest.mark.parametrize("datamodule, make_key, num_classes, mean, std", [
    (CIFAR10, "cifar10", 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    (CIFAR100, "cifar100", 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
])
def test_cifar_eval_images_equal_normalised_pixels(tmp_path, datamodule, make_key, num_classes, mean, std):
    import conftest
    written = getattr(conftest, f"make_{make_key}")(tmp_path)
    dm = datamodule(data_dir=str(tmp_path), batch_size=4)
    assert (dm.num_classes, dm.in_chans, dm.image_size) == (num_classes, 3, 32)
    assert dm.mean == mean and dm.std == std
    dm.setup("fit")
    n_train = len(written["train_labels"])
    assert len(dm.train_dataset) == len(dm.bank_dataset) == n_train
    assert len(dm.val_dataset) == len(written["test_labels"])
    for dataset, split in ((dm.val_dataset, "test"), (dm.bank_dataset, "train")):
        for i in (0, len(dataset) - 1):
            image, label = dataset[i]
            torch.testing.assert_close(image, normalise(written[f"{split}_images"][i], mean, std),
                                       rtol=0, atol=1e-5)
            assert label == written[f"{split}_labels"][i]
    check_every_loader(dm, channels=3, size=32, num_classes=num_classes)


def test_cifar_resized_loaders_and_workers(data_root):
    dm = CIFAR10(data_dir=str(data_root["root"]), batch_size=8, image_size=16, num_workers=1)
    assert dm.persistent_workers
    check_every_loader(dm, channels=3, size=16, num_classes=10)
    assert len(dm.train_dataloader()) == 20 // 8
    dm = CIFAR100(data_dir=str(data_root["root"]), batch_size=64, image_size=24)
    check_every_loader(dm, channels=3, size=24, num_classes=100)
    assert len(dm.train_dataloader()) == 1  # smaller than one batch: the last batch is kept


def test_cifar_train_augmentation_flips_by_default(tmp_path):
    make_cifar10(tmp_path)
    torch.manual_seed(0)
    dm = CIFAR10(data_dir=str(tmp_path), crop_scale=(1.0, 1.0))
    dm.setup("fit")
    pairs = [(dm.train_dataset[i][0], dm.bank_dataset[i][0]) for i in range(20)]
    flipped = sum(torch.equal(image, plain.flip(-1)) for image, plain in pairs)
    unflipped = sum(torch.equal(image, plain) for image, plain in pairs)
    assert flipped + unflipped == 20 and 2 < flipped < 18


# --- MNIST ---------------------------------------------------------------------------------
def test_generated_mnist_reads_back_with_torchvision(data_root):
    reference = torchvision.datasets.MNIST(str(data_root["root"]), train=False)
    assert reference.data.shape == (6, 28, 28)


def test_mnist_eval_images_equal_normalised_pixels(tmp_path):
    import conftest
    written = conftest.make_mnist(tmp_path)
    dm = MNIST(data_dir=str(tmp_path), batch_size=5)
    assert (dm.num_classes, dm.in_chans, dm.image_size, dm.horizontal_flip) == (10, 1, 28, False)
    dm.setup("fit")
    assert len(dm.train_dataset) == 12 and len(dm.val_dataset) == 6
    for dataset, split in ((dm.val_dataset, "test"), (dm.bank_dataset, "train")):
        for i in (0, 5):
            image, label = dataset[i]
            torch.testing.assert_close(image, normalise(written[f"{split}_images"][i], (0.1307,), (0.3081,)),
                                       rtol=0, atol=1e-5)
            assert label == written[f"{split}_labels"][i]
    check_every_loader(dm, channels=1, size=28, num_classes=10)


# --- ImageNet ------------------------------------------------------------------------------
def test_imagenet_class_list_selects_and_reindexes(data_root):
    dm = ImageNet(data_dir=str(data_root["imagenet"]), class_list=str(data_root["imagenet_class_list"]),
                  batch_size=2, image_size=16, eval_crop_ratio=0.8)
    assert dm.num_classes == 2 and dm.in_chans == 3
    # the count, not the None given, is what Lightning compares with the model's num_classes
    assert dm.hparams.num_classes == dm.hparams_initial.num_classes == 2
    dm.setup("fit")
    assert len(dm.train_dataset) == len(dm.val_dataset) == 4
    for dataset in (dm.bank_dataset, dm.val_dataset):
        for path, label in dataset.samples.samples:
            assert IMAGENET_TEST_SUBSET[label] in path
    check_every_loader(dm, channels=3, size=16, num_classes=2)


def test_imagenet_eval_is_resize_then_centre_crop(tmp_path):
    written = make_imagefolder(tmp_path, ["b_class", "a_class"], n_per_class=2, size=(20, 24))
    # Short side 20 = 16 / 0.8: no resize, so the eval image is the centre 16 x 16 crop.
    dm = ImageNet(data_dir=str(tmp_path), num_classes=2, batch_size=2, image_size=16, eval_crop_ratio=0.8)
    dm.setup("fit")
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    for split, dataset in (("val", dm.val_dataset), ("train", dm.bank_dataset)):
        paths = [path for path, _ in dataset.samples.samples]
        for path, name, pixels in written[split]:
            if path.suffix != ".png":
                continue
            image, label = dataset[paths.index(str(path))]
            assert label == ["a_class", "b_class"].index(name)  # sorted folder order without a class list
            torch.testing.assert_close(image, normalise(pixels[2:18, 4:20], mean, std), rtol=0, atol=1e-5)


def test_imagenet_default_eval_resize(tmp_path):
    make_imagefolder(tmp_path, ["x", "y"], n_per_class=1, size=(30, 45), splits=("val",))
    make_imagefolder(tmp_path, ["x", "y"], n_per_class=1, size=(30, 45), splits=("train",))
    dm = ImageNet(data_dir=str(tmp_path), num_classes=2, image_size=16)
    assert dm.image_size == 16 and dm.eval_crop_ratio == 0.875
    dm.setup("validate")
    assert dm.train_dataset is None
    images, labels = one_batch(dm.val_dataloader())
    assert images.shape == (2, 3, 16, 16) and labels.tolist() == [0, 1]
    images, _ = one_batch(dm.bank_dataloader())  # the bank is built on demand after validate
    assert images.shape == (2, 3, 16, 16)


# --- errors --------------------------------------------------------------------------------
def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("datamodule, expected", [
    (CIFAR10, "CIFAR10: no CIFAR-10 python batches under '{root}/cifar-10-batches-py' "
              "(expected data_batch_1..5, test_batch and batches.meta); set download=True or data_dir"),
    (CIFAR100, "CIFAR100: no CIFAR-100 python files under '{root}/cifar-100-python' "
               "(expected train, test and meta); set download=True or data_dir"),
    (MNIST, "MNIST: no MNIST idx files under '{root}/MNIST/raw'"),
])
def test_empty_root_is_one_clear_line(tmp_path, datamodule, expected):
    dm = datamodule(data_dir=str(tmp_path))
    dm.prepare_data()  # download=False: fetches nothing
    with pytest.raises(FileNotFoundError) as excinfo:
        dm.setup("fit")
    assert one_line(excinfo).startswith(expected.format(root=tmp_path))


def test_missing_and_incomplete_roots(tmp_path):
    with pytest.raises(FileNotFoundError) as excinfo:
        CIFAR10(data_dir=str(tmp_path / "nowhere")).setup("validate")
    assert f"'{tmp_path / 'nowhere'}/cifar-10-batches-py'" in one_line(excinfo)
    make_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError) as excinfo:
        CIFAR10(data_dir=str(tmp_path)).setup("fit")
    assert "missing data_batch_3 of the CIFAR-10 python batches" in one_line(excinfo)
    for sub in ("", "imagenet"):
        with pytest.raises(FileNotFoundError) as excinfo:
            ImageNet(data_dir=str(tmp_path / sub)).setup("fit")
        assert one_line(excinfo).startswith(f"ImageNet: no class folders under '{tmp_path / sub / 'train'}'")


def test_imagenet_empty_train_folder_and_class_folders_without_images(tmp_path):
    (tmp_path / "train").mkdir()  # exists, but holds no class folders
    with pytest.raises(FileNotFoundError) as excinfo:
        ImageNet(data_dir=str(tmp_path), num_classes=1).setup("fit")
    assert one_line(excinfo).startswith(f"ImageNet: no class folders under '{tmp_path / 'train'}'")
    make_imagefolder(tmp_path, ["a", "b"], n_per_class=1)
    for image in (tmp_path / "train" / "b").iterdir():  # a class folder with no images
        image.unlink()
    (tmp_path / "train" / "b" / "notes.txt").write_text("not an image")
    with pytest.raises(FileNotFoundError) as excinfo:
        ImageNet(data_dir=str(tmp_path), num_classes=2).setup("fit")
    assert one_line(excinfo).startswith(f"ImageNet: class folders without images under '{tmp_path / 'train'}'")
    assert "b" in one_line(excinfo)


def test_imagenet_val_folder_missing(tmp_path):
    make_imagefolder(tmp_path, ["x"], n_per_class=1, splits=("train",))
    dm = ImageNet(data_dir=str(tmp_path), num_classes=1)
    with pytest.raises(FileNotFoundError) as excinfo:
        dm.setup("validate")
    assert one_line(excinfo).startswith(f"ImageNet: no class folders under '{tmp_path / 'val'}'")


def test_imagenet_class_list_errors(data_root, tmp_path):
    root = str(data_root["imagenet"])
    unknown = make_class_list(tmp_path / "unknown.txt", ["n01440764", "n99999999"])
    dm = ImageNet(data_dir=root, class_list=str(unknown))
    assert dm.num_classes == 2
    with pytest.raises(ValueError) as excinfo:
        dm.setup("fit")
    assert "class_list" in one_line(excinfo) and "n99999999" in str(excinfo.value)
    with pytest.raises(FileNotFoundError, match="class_list file .*absent.txt' not found"):
        ImageNet(data_dir=root, class_list=str(tmp_path / "absent.txt"))
    twice = make_class_list(tmp_path / "twice.txt", ["n01440764", "n01443537", "n01440764"])
    with pytest.raises(ValueError, match="more than once: n01440764"):
        ImageNet(data_dir=root, class_list=str(twice))
    with pytest.raises(ValueError, match="names no class"):
        ImageNet(data_dir=root, class_list=str(make_class_list(tmp_path / "empty.txt", [])))
    with pytest.raises(ValueError, match="num_classes=3 but class_list"):
        ImageNet(data_dir=root, class_list=str(data_root["imagenet_class_list"]), num_classes=3)


def test_imagenet_num_classes_checked_against_folders(data_root):
    dm = ImageNet(data_dir=str(data_root["imagenet"]))
    assert dm.num_classes == 1000
    with pytest.raises(ValueError, match=f"num_classes=1000 but .* has {len(IMAGENET_TEST_CLASSES)} class folders"):
        dm.setup("fit")
    dm = ImageNet(data_dir=str(data_root["imagenet"]), num_classes=4, batch_size=3, image_size=8)
    check_every_loader(dm, channels=3, size=8, num_classes=4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_size=0), "batch_size must be > 0, got 0"),
    (dict(image_size=-32), "image_size must be > 0, got -32"),
    (dict(eval_batch_size=0), "eval_batch_size must be > 0"),
    (dict(num_workers=-1), "num_workers must be >= 0"),
    (dict(crop_scale=(0.5, 0.2)), "crop_scale must be"),
    (dict(eval_crop_ratio=1.5), "eval_crop_ratio must be in"),
    (dict(mean=(0.5,)), "mean needs 3 value"),
    (dict(std=(0.2, 0.2, 0.0)), "std values must be > 0"),
])
def test_bad_fields_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CIFAR10(**kwargs)


def test_digits_bad_fields():
    with pytest.raises(ValueError, match="Digits: batch_size must be > 0"):
        Digits(batch_size=-1)
    with pytest.raises(ValueError, match="ImageNet: num_classes must be > 0"):
        ImageNet(num_classes=0)


def test_loader_before_setup_says_so():
    with pytest.raises(RuntimeError, match=r"call setup\('fit'\)"):
        Digits().train_dataloader()


def test_train_augmentation_off_gives_the_eval_images():
    """The linear-probe protocol trains on unaugmented images: train samples = bank samples."""
    from sklearn.datasets import load_digits

    dm = Digits(train_augmentation=False, image_size=8)
    dm.setup("fit")
    images, labels = next(iter(dm.train_dataloader()))
    raw = load_digits()
    for img, label in zip(images[:5], labels[:5]):
        # an 8x8 eval image is the raw digit /16, normalised: find it among the raw digits
        pixels = img[0].numpy() * dm.std[0] + dm.mean[0]
        match = np.flatnonzero(np.abs(raw.images / 16.0 - pixels).reshape(len(raw.images), -1).max(1) < 1e-5)
        assert len(match) >= 1 and raw.target[match[0]] == int(label)


def test_pin_memory_only_when_batches_go_to_cuda(monkeypatch):
    """pin_memory=True pins on a CUDA run only: on CPU it would cost time and warn."""
    from types import SimpleNamespace

    data = Digits(batch_size=32, image_size=8, pin_memory=True)
    data.setup("fit")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert data.train_dataloader().pin_memory is False  # no trainer, no CUDA
    on = lambda kind: SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(kind)))  # noqa: E731
    data.trainer = on("cpu")
    assert data.train_dataloader().pin_memory is False
    data.trainer = on("cuda")
    assert data.train_dataloader().pin_memory is True and data.val_dataloader().pin_memory is True
    assert Digits(batch_size=32, image_size=8).feeds_cuda() is False
