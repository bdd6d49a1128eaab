"""The shared image datamodule every dataset of shortcutlab subclasses (the decay paper, section 4, data).

Train split: the standard MAE augmentation, RandomResizedCrop(image_size, scale 0.2-1.0, bicubic)
then an optional horizontal flip. Validation/test/predict and the kNN bank (the train split
again): the plain eval transform, resize to ``image_size / eval_crop_ratio`` then centre crop.
Batches are ``(float32 B x C x H x W normalised images, int64 B labels)``.

A subclass sets the class attributes ``dataset_name``, ``num_classes``, ``in_chans``,
``default_mean``, ``default_std`` and implements ``load_split(train)``, returning the raw
samples ``(image, label)`` of one split, where an image is a PIL image or a uint8/float
``C x H x W`` tensor.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision.transforms import InterpolationMode, v2

from datamodules.resumable import ResumableTrainData


class TransformedDataset(Dataset):
    """Applies ``transform`` to the image of every ``(image, label)`` sample of ``samples``."""

    def __init__(self, samples: Dataset, transform: Callable[[Any], torch.Tensor]) -> None:
        self.samples = samples
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.samples[index]
        return self.transform(image), int(label)


class InMemoryImages(Dataset):
    """Images held as one ``N x C x H x W`` tensor with their int64 labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.ndim != 4 or len(images) != len(labels):
            raise ValueError(f"InMemoryImages: expected N x C x H x W images and N labels, got "
                             f"{tuple(images.shape)} and {tuple(labels.shape)}")
        self.images = images
        self.labels = labels.to(torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


def check_positive(owner: str, **fields: int | float) -> None:
    """Raise ``ValueError`` naming the first field that is not > 0."""
    for name, value in fields.items():
        if value <= 0:
            raise ValueError(f"{owner}: {name} must be > 0, got {value}")


def check_loading(name: str, batch_size: int, eval_batch_size: int | None, num_workers: int, image_size: int,
                  eval_crop_ratio: float, crop_scale: Sequence[float]) -> None:
    """One-line errors for loader and crop settings that cannot work."""
    check_positive(name, batch_size=batch_size, image_size=image_size)
    if eval_batch_size is not None:
        check_positive(name, eval_batch_size=eval_batch_size)
    if num_workers < 0:
        raise ValueError(f"{name}: num_workers must be >= 0, got {num_workers}")
    if not 0.0 < eval_crop_ratio <= 1.0:
        raise ValueError(f"{name}: eval_crop_ratio must be in (0, 1], got {eval_crop_ratio}")
    if len(crop_scale) != 2 or not 0.0 < crop_scale[0] <= crop_scale[1] <= 1.0:
        raise ValueError(f"{name}: crop_scale must be (low, high) with 0 < low <= high <= 1, "
                         f"got {tuple(crop_scale)}")


def check_normalisation_and_augmentation(name: str, in_chans: int, mean: Sequence[float], std: Sequence[float],
                                         rand_augment: str | None, random_erasing: float) -> None:
    """One-line errors for per-channel statistics and fine-tuning augmentation that cannot work."""
    for field, stats in (("mean", mean), ("std", std)):
        if len(stats) != in_chans:
            raise ValueError(f"{name}: {field} needs {in_chans} value(s), one per channel, got {len(stats)}")
    if min(std) <= 0:
        raise ValueError(f"{name}: std values must be > 0, got {tuple(std)}")
    if not 0.0 <= random_erasing <= 1.0:
        raise ValueError(f"{name}: random_erasing must be a probability in [0, 1], got {random_erasing}")
    if random_erasing and rand_augment is None:
        raise ValueError(f"{name}: random_erasing comes with rand_augment (timm's fine-tuning transform)")


def _to_pil(image: Any) -> Any:
    """timm's RandAugment works on PIL images: a uint8 or float tensor becomes one."""
    return v2.functional.to_pil_image(image) if isinstance(image, torch.Tensor) else image


class ImageDataModule(ResumableTrainData, L.LightningDataModule):
    """Image classification data with the MAE train augmentation and plain eval transforms.

    Args:
        data_dir: root folder of the dataset files (None for data bundled with a package).
        batch_size: per-device batch size of the train loader.
        eval_batch_size: batch size of the val/test/predict/bank loaders (None: ``batch_size``).
        num_workers: loader worker processes (0: load in the main process).
        image_size: side of the square images the model sees.
        train_augmentation: augment the train split (off: the eval transform, as the linear-probe
            protocol of the linear-probe protocol wants; the train loader still shuffles).
        horizontal_flip: random horizontal flip in the train augmentation.
        crop_scale: area range of RandomResizedCrop in the train augmentation.
        eval_crop_ratio: eval resizes to ``image_size / eval_crop_ratio`` then centre-crops
            (1.0: resize straight to ``image_size``; ImageNet uses 0.875).
        mean, std: per-channel normalisation (None: the dataset's usual statistics).
        pin_memory: page-locked batches for faster host-to-GPU copies (applied only when the
            batches go to a CUDA device: on a CPU run it would only cost time and a warning).
        drop_last_train: drop the last incomplete train batch (kept when it would be the only one).
        persistent_workers: keep workers alive between epochs (only with ``num_workers > 0``).
        rand_augment: timm's RandAugment policy for the train split (MAE's fine-tuning:
            ``rand-m9-mstd0.5-inc1``), through timm's transforms factory with its
            RandomResizedCrop (``crop_scale``, bicubic) and flip; ``None``: the MAE pre-training
            augmentation above.
        random_erasing: probability of timm's RandomErasing (pixel mode) after normalisation,
            with ``rand_augment`` (MAE's fine-tuning: 0.25).
    """

    dataset_name: ClassVar[str] = "ImageDataModule"
    num_classes: int
    class_names: Sequence[str] | None = None  # label -> name, for pictures (None: the index is the name)
    in_chans: int
    default_mean: ClassVar[tuple[float, ...]]
    default_std: ClassVar[tuple[float, ...]]

    def __init__(
        self,
        data_dir: str | None = "data",
        batch_size: int = 256,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        image_size: int = 32,
        train_augmentation: bool = True,
        horizontal_flip: bool = True,
        crop_scale: tuple[float, float] = (0.2, 1.0),
        eval_crop_ratio: float = 1.0,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        pin_memory: bool = False,
        drop_last_train: bool = True,
        persistent_workers: bool = True,
        rand_augment: str | None = None,
        random_erasing: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        name = self.dataset_name
        check_loading(name, batch_size, eval_batch_size, num_workers, image_size, eval_crop_ratio, crop_scale)
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.image_size = image_size
        self.train_augmentation = train_augmentation
        self.horizontal_flip = horizontal_flip
        self.crop_scale = (float(crop_scale[0]), float(crop_scale[1]))
        self.eval_crop_ratio = eval_crop_ratio
        self.mean = tuple(float(m) for m in (mean if mean is not None else self.default_mean))
        self.std = tuple(float(s) for s in (std if std is not None else self.default_std))
        check_normalisation_and_augmentation(name, self.in_chans, self.mean, self.std, rand_augment, random_erasing)
        self.rand_augment, self.random_erasing = rand_augment, float(random_erasing)
        self.pin_memory = pin_memory
        self.drop_last_train = drop_last_train
        self.persistent_workers = persistent_workers and num_workers > 0
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.bank_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self.predict_dataset: Dataset | None = None

    # --- what a subclass provides -------------------------------------------------------
    def record_resolved_hparam(self, name: str, value: Any) -> None:
        """Store a value resolved in ``__init__`` (e.g. ``num_classes`` from a class list) in the
        hyperparameters, including the initial copy Lightning compares with the model's: it
        refuses a run whose module and datamodule disagree on a shared key."""
        self.hparams[name] = value
        self._hparams_initial[name] = value

    def load_split(self, train: bool) -> Dataset:
        """Raw ``(image, label)`` samples of the train (True) or held-out (False) split."""
        raise NotImplementedError(f"{type(self).__name__} must implement load_split(train)")

    # --- transforms ---------------------------------------------------------------------
    def to_normalised_tensor(self) -> list[Callable]:
        """PIL image or uint8/float tensor -> plain float32 tensor, normalised per channel."""
        return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(self.mean, self.std), v2.ToPureTensor()]

    def train_transform(self) -> Callable[[Any], torch.Tensor]:
        """MAE augmentation: RandomResizedCrop(scale 0.2-1.0, bicubic) and optional flip; with
        ``rand_augment``, timm's fine-tuning transform instead."""
        if self.rand_augment is not None:
            return self.finetune_transform()
        steps: list[Callable] = [v2.RandomResizedCrop(self.image_size, scale=self.crop_scale,
                                                      interpolation=InterpolationMode.BICUBIC,
                                                      antialias=True)]
        if self.horizontal_flip:
            steps.append(v2.RandomHorizontalFlip())
        return v2.Compose(steps + self.to_normalised_tensor())

    def finetune_transform(self) -> Callable[[Any], torch.Tensor]:
        """timm's training transform as MAE's fine-tuning builds it (``create_transform``):
        RandomResizedCrop (``crop_scale``, bicubic), flip, RandAugment, normalisation, RandomErasing."""
        from timm.data import create_transform

        timm_transform = create_transform(self.image_size, is_training=True, scale=self.crop_scale,
                                          hflip=0.5 if self.horizontal_flip else 0.0, color_jitter=None,
                                          auto_augment=self.rand_augment, interpolation="bicubic",
                                          re_prob=self.random_erasing, re_mode="pixel", re_count=1,
                                          mean=self.mean, std=self.std)
        return v2.Compose([_to_pil, timm_transform])

    def eval_transform(self) -> Callable[[Any], torch.Tensor]:
        """Resize the short side to ``image_size / eval_crop_ratio`` (bicubic), centre crop."""
        resize_to = int(round(self.image_size / self.eval_crop_ratio))
        return v2.Compose([v2.Resize(resize_to, interpolation=InterpolationMode.BICUBIC, antialias=True),
                           v2.CenterCrop(self.image_size)] + self.to_normalised_tensor())

    # --- datasets -----------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        """fit: train, bank and val datasets; validate: val; test: test; predict: predict.

        Val, test and predict are the same held-out split; the bank is built on demand by
        ``bank_dataloader`` when only validate/test ran.
        """
        if stage in (None, "fit", "validate"):
            self.held_out_eval_dataset()
        if stage in (None, "fit"):
            if self.train_dataset is None or self.bank_dataset is None:
                self.bank_dataset, self.train_dataset = self.make_train_datasets()
        if stage in (None, "test") and self.test_dataset is None:
            self.test_dataset = self.held_out_eval_dataset()
        if stage in (None, "predict") and self.predict_dataset is None:
            self.predict_dataset = self.held_out_eval_dataset()

    def make_train_datasets(self) -> tuple[Dataset, Dataset]:
        """``(bank, train)``: the train split through the eval transform and through the
        augmentation (the bank itself when ``train_augmentation`` is off)."""
        train_samples = self.load_split(train=True)
        bank = self.wrap_eval(train_samples)
        return bank, (TransformedDataset(train_samples, self.train_transform()) if self.train_augmentation else bank)

    def wrap_eval(self, samples: Dataset) -> Dataset:
        """``samples`` seen through the eval transform."""
        return TransformedDataset(samples, self.eval_transform())

    def make_eval_dataset(self, train: bool) -> Dataset:
        return self.wrap_eval(self.load_split(train=train))

    def held_out_eval_dataset(self) -> Dataset:
        """The held-out split with the eval transform (shared by val, test and predict)."""
        if self.val_dataset is None:
            self.val_dataset = self.make_eval_dataset(train=False)
        return self.val_dataset

    # --- loaders ------------------------------------------------------------------------
    def make_loader(self, dataset: Dataset | None, stage: str, batch_size: int, shuffle: bool = False,
                    drop_last: bool = False, sampler: Sampler | None = None) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{self.dataset_name}: call setup({stage!r}) before asking for its loader")
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle and sampler is None,
                          sampler=sampler, drop_last=drop_last, num_workers=self.num_workers,
                          pin_memory=self.pin_memory and self.feeds_cuda(), persistent_workers=self.persistent_workers)

    def train_device(self) -> torch.device:
        """Where the batches go: the attached trainer's device, else the first GPU if any (a
        loader built outside a Trainer)."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return trainer.strategy.root_device
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    def feeds_cuda(self) -> bool:
        """Whether the batches go to a CUDA device (:meth:`train_device`)."""
        return self.train_device().type == "cuda"

    def train_dataloader(self) -> DataLoader:
        """Shuffled by epoch, resumable mid-epoch (``datamodules.resumable``)."""
        if self.train_dataset is None:
            raise RuntimeError(f"{self.dataset_name}: call setup('fit') before asking for its loader")
        # Dropping the last batch of a split smaller than one batch would leave an empty epoch.
        drop_last = self.drop_last_train and len(self.train_dataset) >= self.batch_size
        options = dict(num_workers=self.num_workers, pin_memory=self.pin_memory and self.feeds_cuda(),
                       persistent_workers=self.persistent_workers)
        return self.resumable_train_loader(self.train_dataset, self.batch_size, drop_last=drop_last,
                                           **{**options, **self.train_loader_options()})

    def train_loader_options(self) -> dict[str, Any]:
        """DataLoader arguments of the train loader that a subclass sets (e.g. a ``collate_fn``)."""
        return {}

    def val_dataloader(self) -> DataLoader:
        return self.make_loader(self.val_dataset, "validate", self.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self.make_loader(self.test_dataset, "test", self.eval_batch_size)

    def predict_dataloader(self) -> DataLoader:
        return self.make_loader(self.predict_dataset, "predict", self.eval_batch_size)

    def bank_dataloader(self, sampler: Sampler | None = None) -> DataLoader:
        """The train split with the eval transform, in order (the kNN feature bank).

        Sets the bank up when only validate/test ran ``setup``. ``sampler`` (e.g. a
        DistributedSampler) splits it between processes.
        """
        if self.bank_dataset is None:
            self.bank_dataset = self.make_eval_dataset(train=True)
        return self.make_loader(self.bank_dataset, "fit", self.eval_batch_size, sampler=sampler)
