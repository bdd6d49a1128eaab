"""``torch.compile`` as an option: a fit with ``CompileBlocks`` or ``CompileNetwork`` trains the
same network as eager within 1e-5 and writes a checkpoint an eager network loads as is."""
from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from callbacks.reliability.exact_resume import ExactResume
from callbacks.training.compile import CompileBlocks, CompileNetwork
from datamodules.digits import Digits
from lightning_mods.backbone.residual import residual_blocks
from lightning_mods.backbone.shortcut import ShortcutSchedule
from lightning_mods.backbone.vit import DecayedVisionTransformer
from lightning_mods.classifier import ImageClassifier
from lightning_mods.mae import MaskedAutoencoder
from lightning_mods.backbone.masked_autoencoder import MaskedAutoencoderViT


def tiny_classifier() -> ImageClassifier:
    torch.manual_seed(0)
    backbone = DecayedVisionTransformer(shortcut=ShortcutSchedule("linear", 0.6), img_size=8, patch_size=4,
                                        in_chans=1, num_classes=10, embed_dim=16, depth=2, num_heads=2)
    return ImageClassifier(backbone, num_classes=10, in_chans=1, optimizer="adamw", base_lr=1e-3, warmup_epochs=0)


def fit(callbacks: list, tmp_path) -> tuple[ImageClassifier, L.Trainer]:  # noqa: ANN001
    L.seed_everything(0, verbose=False)
    module = tiny_classifier()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=callbacks,
                        default_root_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=Digits(batch_size=16, image_size=8))
    return module, trainer


@pytest.mark.slow
def test_compiled_fit_equals_eager_and_its_checkpoint_loads_without_compile(tmp_path):
    compiled, trainer = fit([CompileBlocks()], tmp_path / "compiled")
    eager, _ = fit([], tmp_path / "eager")
    assert all(block._compiled_call_impl is not None for block in residual_blocks(compiled))
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no _orig_mod. prefix
    for (name, got), want in zip(compiled.state_dict().items(), eager.state_dict().values()):
        if got.is_floating_point():
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
    checkpoint = next((tmp_path / "compiled").rglob("*.ckpt"))
    loaded = tiny_classifier()  # an eager network of the same settings, strict load
    loaded.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"])
    assert all(getattr(block, "_compiled_call_impl", None) is None for block in residual_blocks(loaded))
    images = torch.rand(4, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(images), compiled.eval()(images), rtol=0, atol=1e-5)


def test_compile_needs_residual_blocks():
    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="no residual blocks"):
        CompileBlocks().setup(None, Plain(), "fit")


def tiny_mae():
    torch.manual_seed(0)
    # zero_init_branches off: the first steps' loss and gradients depend on every weight and mask
    return MaskedAutoencoder(MaskedAutoencoderViT(img_size=8, in_chans=1, patch_size=4, embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2, zero_init_branches=False, shortcut=ShortcutSchedule("linear", 0.6)), warmup_epochs=0, num_reconstructions=0)


def fit_mae(callbacks: list, root) -> tuple[MaskedAutoencoder, dict]:  # noqa: ANN001
    L.seed_everything(0, verbose=False)
    module = tiny_mae()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=1, val_check_interval=3, num_sanity_val_steps=0,
                        callbacks=callbacks, default_root_dir=root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=Digits(batch_size=16, image_size=8))
    return module, {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.slow
def test_a_fit_with_the_network_compiled_draws_the_eager_masks_and_trains_the_same_network(tmp_path):
    """The MAE's masks are drawn inside the compiled call: the same draws as eager give the same
    losses and weights; the checkpoint loads into an eager network as is."""
    compiled, compiled_metrics = fit_mae([CompileNetwork(backend="aot_eager")], tmp_path / "compiled")
    eager, eager_metrics = fit_mae([], tmp_path / "eager")
    assert compiled._compiled_call_impl is not None
    assert not any(getattr(block, "_compiled_call_impl", None) for block in residual_blocks(compiled))
    assert set(compiled_metrics) == set(eager_metrics) >= {"train/loss_step", "val/loss"}
    for name, value in eager_metrics.items():
        assert compiled_metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    assert list(compiled.state_dict()) == list(eager.state_dict())
    for (name, got), want in zip(compiled.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
    loss, _, _ = compiled.train()(torch.rand(5, 1, 8, 8))  # a second batch size (an epoch's last): compiled anew
    assert torch.isfinite(loss)
    loaded = tiny_mae()
    loaded.load_state_dict(torch.load(next((tmp_path / "compiled").rglob("*.ckpt")), map_location="cpu",
                                      weights_only=True)["state_dict"])
    assert getattr(loaded, "_compiled_call_impl", None) is None


def test_the_network_compile_asks_inductor_for_cuda_graphs_and_eager_random_draws():
    assert CompileNetwork().compile_options() == {
        "backend": "inductor", "fullgraph": False, "dynamic": False,
        "options": {"triton.cudagraphs": True, "fallback_random": True}}
    assert CompileNetwork(mode=None).compile_options()["options"] == {"fallback_random": True}
    assert CompileNetwork(mode=None, eager_random=False).compile_options() == {
        "backend": "inductor", "fullgraph": False, "dynamic": False}
    assert CompileNetwork(mode="max-autotune", eager_random=False).compile_options()["mode"] == "max-autotune"
    assert "options" not in CompileNetwork(backend="aot_eager").compile_options()  # modes are inductor's
    with pytest.raises(ValueError, match="CompileNetwork: mode 'fast' is not an inductor mode"):
        CompileNetwork(mode="fast")


def test_the_network_and_its_blocks_are_not_compiled_both():
    module = tiny_mae()
    CompileBlocks(backend="aot_eager").setup(None, module, "fit")
    with pytest.raises(ValueError, match="compile the network or its blocks, not both"):
        CompileNetwork(backend="aot_eager").setup(None, module, "fit")
    whole = tiny_mae()
    CompileNetwork(backend="aot_eager").setup(None, whole, "fit")
    with pytest.raises(ValueError, match="compile the network or its blocks, not both"):
        CompileBlocks(backend="aot_eager").setup(None, whole, "fit")


def resumable_fit(root, compiled: bool, save=None, ckpt_path=None) -> dict:  # noqa: ANN001
    """test_exact_resume's tiny MAE for its 3 epochs of 4 steps, with ExactResume."""
    from test_exact_resume import BATCHES, EPOCHS
    from test_exact_resume import tiny_mae as resumable_mae

    L.seed_everything(0, verbose=False)
    module = resumable_mae("linear")
    callbacks = [ExactResume(), *([CompileNetwork(backend="aot_eager")] if compiled else []), *([save] if save else [])]
    trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=False, callbacks=callbacks,
                        enable_checkpointing=save is not None, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_train_batches=BATCHES, limit_val_batches=0, default_root_dir=root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, Digits(batch_size=32, image_size=8), ckpt_path=ckpt_path)
    return {"weights": module.state_dict(), "optimizer": trainer.optimizers[0].state_dict()["state"],
            "step": trainer.global_step}


@pytest.mark.slow
def test_an_eager_run_resumed_from_a_compiled_run_s_checkpoint_equals_the_uninterrupted_eager_run(tmp_path):
    """Mid-epoch, from a checkpoint the network-compiled run wrote as it was interrupted: the same
    masks and weights go on (the compiled run drew what eager draws)."""
    from test_exact_resume import MID_EPOCH, Interrupted, SaveAt

    full = resumable_fit(tmp_path / "full", compiled=False)
    with pytest.raises(Interrupted):
        resumable_fit(tmp_path / "compiled", compiled=True, save=SaveAt(tmp_path / "compiled", (MID_EPOCH,), interrupt=True))
    resumed = resumable_fit(tmp_path / "resumed", compiled=False, ckpt_path=tmp_path / "compiled" / f"step{MID_EPOCH}.ckpt")
    assert resumed["step"] == full["step"] > MID_EPOCH
    torch.testing.assert_close(resumed["weights"], full["weights"], rtol=0, atol=1e-6)
    torch.testing.assert_close(resumed["optimizer"], full["optimizer"], rtol=0, atol=1e-6)
