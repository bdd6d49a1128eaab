"""ImageNet's decoder="gpu" with its batches decoded one ahead in a background thread
(datamodules/_decode_ahead.py), through the CPU stand-in: the same batches as decoding in line, a
checkpoint's loader position counts the batches handed out (not the one being decoded) and
resumes at the first not trained, and the thread stops at the epoch's end, on an error (raised
in the loop) and when the loop drops the iterator."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

from benchmarks.data_pipeline import write_jpeg_folder
from datamodules._decode_ahead import DecodeAhead
from datamodules.imagenet import ImageNet


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    root = tmp_path_factory.mktemp("in")
    write_jpeg_folder(str(root), per_class=6)
    return root


def decode_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("decode-ahead")]


def imagenet(jpegs, ahead: bool) -> ImageNet:
    data = ImageNet(data_dir=str(jpegs), num_classes=2, batch_size=4, decoder="gpu", image_size=32, num_workers=2,
                    decode_ahead=ahead, persistent_workers=False)
    data.setup("fit")
    return data


def epoch(data: ImageNet, loader) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    moved = [data.transfer_batch_to_device(batch, torch.device("cpu"), 0) for batch in loader]
    return [(images.clone(), labels.clone()) for images, labels in moved]


def test_the_same_batches_as_decoding_in_line_and_no_thread_after_the_epoch(jpegs):
    in_line, ahead = imagenet(jpegs, ahead=False), imagenet(jpegs, ahead=True)
    expected, got = epoch(in_line, in_line.train_dataloader()), epoch(ahead, ahead.train_dataloader())
    assert len(got) == len(expected) == 3
    for (a, b), (c, d) in zip(got, expected):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert not decode_threads()


def test_a_mid_epoch_position_counts_the_batches_handed_out_and_resumes_after_them(jpegs):
    data = imagenet(jpegs, ahead=True)
    full = epoch(data, data.train_dataloader())
    loader = data.train_dataloader()  # the next epoch's order: set it back to epoch 0's
    loader.sampler.set_epoch(0)
    iterator = iter(loader)
    first = data.transfer_batch_to_device(next(iterator), torch.device("cpu"), 0)
    assert torch.equal(first[1], full[0][1])
    assert decode_threads()  # the second batch is being decoded
    assert loader.position() == {"epoch": 0, "batches": 1}  # not counted until handed out
    resumed_data = imagenet(jpegs, ahead=True)
    resumed_data.load_state_dict({"train_position": loader.position()})
    rest = epoch(resumed_data, resumed_data.train_dataloader())
    assert [labels.tolist() for _, labels in rest] == [labels.tolist() for _, labels in full[1:]]
    del iterator  # the loop drops the iterator mid-epoch (an exception, a pre-emption): the thread ends
    gc.collect()
    assert not decode_threads()


def test_an_error_while_decoding_is_raised_in_the_loop_and_stops_the_thread():
    def prepare(batch: int) -> int:
        if batch == 2:
            raise RuntimeError("cannot decode batch 2")
        return batch * 10

    ahead = DecodeAhead(iter(range(5)), prepare, torch.device("cpu"))
    assert next(ahead) == 0 and next(ahead) == 10
    with pytest.raises(RuntimeError, match="cannot decode batch 2"):
        next(ahead)
    assert not decode_threads()
    with pytest.raises(StopIteration):
        next(ahead)


def test_the_next_batch_is_taken_when_the_current_one_is_handed_out():
    taken = []

    def source():
        for i in range(3):
            taken.append(i)
            yield i

    ahead = DecodeAhead(source(), lambda b: b, torch.device("cpu"))
    assert next(ahead) == 0 and taken == [0, 1]  # batch 1 already on its way
    assert list(ahead) == [1, 2] and not decode_threads()


class Stop(Exception):
    """Raised by the module below in its third training step."""


@pytest.mark.parametrize("failing", [False, True], ids=["max_steps mid-epoch", "an error in a step"])
def test_a_fit_that_ends_mid_epoch_or_fails_leaves_no_thread(jpegs, tmp_path, failing):
    from lightning.pytorch import Trainer

    from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT
    from lightning_mods.mae import MaskedAutoencoder

    class Module(MaskedAutoencoder):
        def training_step(self, batch, batch_idx):  # noqa: ANN001
            assert batch[0].shape == (4, 3, 32, 32)  # decoded ahead: the step gets pixels
            if failing and batch_idx == 2:
                raise Stop("a step failed")
            return super().training_step(batch, batch_idx)

    model = Module(MaskedAutoencoderViT(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2,
                                        decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2),
                   num_reconstructions=0)
    trainer = Trainer(max_steps=2 if not failing else 10, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                      accelerator="cpu")
    data = ImageNet(data_dir=str(jpegs), num_classes=2, batch_size=4, decoder="gpu", image_size=32, num_workers=2)
    if failing:
        with pytest.raises(Stop):
            trainer.fit(model, datamodule=data)
    else:
        trainer.fit(model, datamodule=data)
        assert trainer.global_step == 2  # of 3 batches an epoch: the third was being decoded
    gc.collect()
    assert not decode_threads()
