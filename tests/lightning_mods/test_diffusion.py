"""U-ViT diffusion (the decay paper, section 5): forward noising against a float64 closed form, the loss,
the three samplers, classifier-free guidance, EMA weights at validation, the digits CLI run, and a
checkpoint validated and sampled (``shortcutlab sample``) with another sampler, as
docs/getting-started.md shows."""
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch.utils.data import DataLoader, TensorDataset

from commands import lightning_cli as cli
from lightning_mods._generation.guidance import drop_labels, guided_noise
from helpers.diffusion_modules import diffusion_module

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_diffusion_quick.yaml"
TINY = dict(image_size=8, in_chans=1, patch_size=2, embed_dim=32, depth=2, num_heads=4,
            pixel_mean=[0.5], pixel_std=[0.5], num_sampling_steps=4, zero_init_branches=False)


def float64_alphas_cumprod(schedule: str, beta_start: float, beta_end: float, steps: int = 1000) -> np.ndarray:
    if schedule == "linear":
        betas = np.linspace(beta_start, beta_end, steps, dtype=np.float64)
    else:  # scaled_linear: linear in sqrt(beta)
        betas = np.linspace(beta_start ** 0.5, beta_end ** 0.5, steps, dtype=np.float64) ** 2
    return np.cumprod(1.0 - betas)


@pytest.mark.parametrize("schedule,start,end", [("linear", 1e-4, 0.02), ("scaled_linear", 0.00085, 0.012)])
def test_forward_noising_matches_float64_closed_form(schedule, start, end):
    module = diffusion_module(**TINY, beta_schedule=schedule, beta_start=start, beta_end=end)
    abar = float64_alphas_cumprod(schedule, start, end)
    rng = np.random.default_rng(0)
    x0, noise = rng.standard_normal((5, 1, 8, 8)), rng.standard_normal((5, 1, 8, 8))
    t = np.array([0, 1, 250, 700, 999])
    expected = np.sqrt(abar[t])[:, None, None, None] * x0 + np.sqrt(1.0 - abar[t])[:, None, None, None] * noise
    got = module.add_noise(torch.tensor(x0, dtype=torch.float32), torch.tensor(noise, dtype=torch.float32),
                           torch.tensor(t))
    # diffusers keeps betas and their cumulative product in float32: ~1e-5 absolute here
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=0, atol=2e-5)
    assert abar[-1] < 1e-3 if schedule == "linear" else abar[-1] < 5e-3  # the schedule ends near pure noise


def test_loss_is_noise_prediction_mse():
    torch.manual_seed(0)
    module = diffusion_module(**TINY)
    x0 = torch.rand(4, 1, 8, 8) * 2 - 1
    loss = module.diffusion_loss(x0, None, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)  # the same draws, in the documented order: noise, then t
    noise = torch.randn(x0.shape, generator=gen)
    t = torch.randint(0, 1000, (4,), generator=gen)
    abar = float64_alphas_cumprod("linear", 1e-4, 0.02)[t.numpy()][:, None, None, None]
    xt = torch.tensor(np.sqrt(abar) * x0.double().numpy() + np.sqrt(1 - abar) * noise.double().numpy()).float()
    with torch.no_grad():
        expected = ((module(xt, t).double() - noise.double()) ** 2).mean().item()
    assert loss.item() == pytest.approx(expected, rel=1e-4)


def test_pixel_space_round_trip_uses_the_datamodule_normalisation():
    module = diffusion_module(**{**TINY, "pixel_mean": [0.3], "pixel_std": [0.2]})
    pixels = torch.rand(2, 1, 8, 8)
    normalised = (pixels - 0.3) / 0.2
    torch.testing.assert_close(module.to_model_space(normalised), pixels * 2 - 1)
    torch.testing.assert_close(module.to_pixels(module.to_model_space(normalised)), pixels)


@pytest.mark.parametrize("sampler,process", [("ddpm", "discrete"), ("ddim", "discrete"), ("dpmsolver++", "discrete"),
                                             ("dpmsolver++_singlestep", "discrete"), ("euler_maruyama", "vp_sde")])
def test_sampler_shape_range_and_seed_determinism(sampler, process):
    torch.manual_seed(0)
    module = diffusion_module(**TINY, sampler=sampler, noise_process=process)
    raw = module.sample(3, seed=7)
    assert raw.shape == (3, 1, 8, 8) and torch.isfinite(raw).all()
    if sampler in ("ddpm", "ddim"):  # DDPM/DDIM clip the predicted x0 to [-1, 1] in pixel mode
        assert raw.abs().max() <= 1.0 + 1e-5
    images = module.generate_images(3, seed=7)
    assert images.shape == (3, 1, 8, 8) and images.min() >= 0 and images.max() <= 1
    torch.testing.assert_close(images, module.to_pixels(raw), rtol=0, atol=0)
    assert not torch.equal(raw, module.sample(3, seed=8))
    assert module.training  # sampling restores the mode


@pytest.mark.parametrize("sampler,steps", [("ddpm", 1000), ("ddpm", 20), ("ddpm", 7), ("ddim", 50), ("ddim", 8), ("dpmsolver++", 7),
                                           ("dpmsolver++", 25), ("dpmsolver++_singlestep", 50), ("dpmsolver++_singlestep", 7)])
def test_samplers_recover_a_point_mass_with_the_exact_noise(sampler, steps):
    """Data = one image x0: the exact noise is (x_t - sqrt(abar_t) x0) / sqrt(1 - abar_t), in float64
    from the closed form, and every sampler must then land on x0 whatever its number of steps."""
    module = diffusion_module(**{**TINY, "sampler": sampler, "num_sampling_steps": steps})
    x0 = torch.rand(1, 1, 8, 8, generator=torch.Generator().manual_seed(3)) * 1.6 - 0.8
    abar = torch.tensor(float64_alphas_cumprod("linear", 1e-4, 0.02), dtype=torch.float64)

    def exact_noise(x, t, labels=None, guidance_scale=1.0):
        a = abar[int(t)]
        return ((x.double() - a.sqrt() * x0.double()) / (1 - a).sqrt()).float()

    module.predict_noise = exact_noise
    sample = module.sample(2, seed=0)
    torch.testing.assert_close(sample, x0.expand(2, -1, -1, -1), atol=2e-3, rtol=0)


def test_ddim_steps_must_divide_the_training_timesteps():
    # with 7 of 1000 steps diffusers' DDIM misses the point mass above by 0.03
    with pytest.raises(ValueError, match="num_sampling_steps for ddim must divide"):
        diffusion_module(**{**TINY, "sampler": "ddim", "num_sampling_steps": 7})


def test_classifier_free_guidance_combines_conditional_and_null_predictions():
    module = diffusion_module(**TINY, num_classes=3, class_conditional=True)

    class ClassOffset(torch.nn.Module):  # eps = x + 10 * label (null class = 3)
        null_class = 3

        def forward(self, x, t, y):
            return x + 10.0 * y.float().view(-1, 1, 1, 1)

    module.network = ClassOffset()
    x, t, labels = torch.randn(2, 1, 8, 8), torch.tensor(5), torch.tensor([0, 2])
    eps = module.predict_noise(x, t, labels, guidance_scale=2.5)
    cond, null = x + 10.0 * labels.float().view(-1, 1, 1, 1), x + 30.0
    torch.testing.assert_close(eps, null + 2.5 * (cond - null))
    torch.testing.assert_close(module.predict_noise(x, t, labels, guidance_scale=1.0), cond)
    torch.testing.assert_close(guided_noise(cond, null, 0.0), null)


def test_label_dropout():
    labels = torch.arange(1000) % 7
    torch.testing.assert_close(drop_labels(labels, 0.0, 7), labels)
    assert (drop_labels(labels, 1.0, 7) == 7).all()
    dropped = (drop_labels(labels, 0.25, 7, torch.Generator().manual_seed(0)) == 7).float().mean().item()
    assert 0.2 < dropped < 0.3


def test_class_conditional_sampling_respects_the_label():
    """Class 0 images are all -0.8, class 1 images all +0.8; samples must follow the label."""
    torch.manual_seed(0)
    module = diffusion_module(**{**TINY, "image_size": 4, "num_classes": 2, "class_conditional": True,
                                "sampler": "ddim", "num_sampling_steps": 10})
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    for _ in range(200):
        labels = torch.randint(0, 2, (64,))
        x0 = (labels.float() * 1.6 - 0.8).view(-1, 1, 1, 1).expand(-1, 1, 4, 4)
        loss = module.diffusion_loss(x0, module.condition(labels, 0.2))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    samples = module.sample(16, torch.tensor([0] * 8 + [1] * 8), seed=0, guidance_scale=2.0)
    assert samples[:8].mean() < -0.3 and samples[8:].mean() > 0.3
    with pytest.raises(ValueError, match="labels"):
        diffusion_module(**TINY).sample(2, torch.tensor([0, 1]))


def test_evaluation_features_follow_the_contract():
    torch.manual_seed(0)
    module = diffusion_module(**{**TINY, "depth": 4, "num_classes": 3, "class_conditional": True}).eval()
    images = torch.randn(5, 1, 8, 8)
    feats = module.forward_features(images)
    blocks = module.forward_intermediates(images, intermediates_only=True)
    assert feats.shape == (5, 32) and len(blocks) == module.network.num_blocks == 5
    torch.testing.assert_close(feats, blocks[module.feature_block], rtol=0, atol=0)  # default: the mid block
    torch.testing.assert_close(feats, module.forward_features(images), rtol=0, atol=0)  # fixed noise
    # by hand: noised at feature_timestep, null class, patch tokens only (2 prefix tokens)
    x0 = module.to_model_space(images)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    t = torch.full((5,), module.hparams.feature_timestep)
    tokens = module.network.forward_blocks(module.add_noise(x0, noise, t), t, torch.full((5,), 3))[2]
    torch.testing.assert_close(feats, tokens[:, 2:].mean(1))
    assert not torch.allclose(module.noised_block_features(images, [2], timestep=900)[0], feats)


def test_bad_arguments_raise_one_line_errors():
    for kwargs, field in [({"sampler": "euler"}, "sampler"), ({"num_sampling_steps": 0}, "num_sampling_steps"),
                          ({"class_conditional": True}, "num_classes"), ({"feature_block": 3}, "feature_block"),
                          ({"beta_schedule": "cosine"}, "beta_schedule"), ({"lr_schedule": "step"}, "lr_schedule"),
                          ({"label_dropout": 1.5}, "label_dropout"), ({"pixel_mean": [0.5, 0.5]}, "pixel_mean"),
                          ({"feature_timestep": 1000}, "feature_timestep"),
                          ({"sampler": "euler_maruyama"}, "noise_process"), ({"noise_process": "sde"}, "noise_process")]:
        with pytest.raises(ValueError, match=field):
            diffusion_module(**{**TINY, **kwargs})


def test_constant_lr_schedule_warms_up_then_holds_the_peak():
    from types import SimpleNamespace
    module = diffusion_module(**{**TINY, "warmup_steps": 10, "lr_schedule": "constant"})
    module.trainer = SimpleNamespace(estimated_stepping_batches=100)
    scheduler = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    multiplier = scheduler.lr_lambdas[0]
    assert multiplier(0) == 0.0 and multiplier(1) == 0.1 and multiplier(10) == 1.0 and multiplier(50) == 1.0 and multiplier(99) == 1.0


class RecordWeights(Callback):
    """The training weights after the last optimiser step, before validation swaps them."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.training_weights = [p.detach().clone() for p in pl_module.parameters()]


def test_validation_samples_with_the_ema_weights(tmp_path):
    torch.manual_seed(0)
    module = diffusion_module(**{**TINY, "lr": 1e-2, "warmup_steps": 0, "num_sample_images": 2})
    seen = {}

    def record_grid():
        seen["weights"] = [p.detach().clone() for p in module.parameters()]

    module.log_sample_grid = record_grid
    ema, record = EMAWeightAveraging(decay=0.5), RecordWeights()
    data = TensorDataset(torch.randn(16, 1, 8, 8), torch.zeros(16, dtype=torch.long))
    trainer = Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=1, callbacks=[record, ema],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, accelerator="cpu")
    trainer.fit(module, DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    averaged = list(ema._average_model.module.parameters())
    assert all(torch.equal(a, b) for a, b in zip(seen["weights"], averaged))
    assert any(not torch.equal(a, b) for a, b in zip(seen["weights"], record.training_weights))


@pytest.mark.slow
def test_digits_config_fits_one_step_and_validates_from_its_checkpoint(tmp_path):
    args = ["--config", str(CONFIG), "--trainer.limit_train_batches=1", "--trainer.max_epochs=1",
            "--trainer.limit_val_batches=1", "--trainer.check_val_every_n_epoch=1", "--trainer.accelerator=cpu",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
            "--model.init_args.num_sampling_steps=2", "--model.init_args.num_sample_images=4"]
    fitted = cli.main(["fit", *args])
    fit_loss = fitted.trainer.callback_metrics["val/loss"].item()
    ckpt = fitted.trainer.checkpoint_callback.last_model_path
    assert Path(ckpt).is_file()
    hparams = torch.load(ckpt, weights_only=True, map_location="cpu")["hyper_parameters"]
    assert hparams["pixel_mean"] == pytest.approx([0.3054]) and hparams["class_conditional"]
    validated = cli.main(["validate", *args, "--ckpt_path", ckpt])
    # the checkpoint's state_dict holds the EMA weights that the fit's validation used
    assert validated.trainer.callback_metrics["val/loss"].item() == pytest.approx(fit_loss, rel=1e-6)
    pictures = sorted(tmp_path.rglob("diffusion_samples_step*.png"))
    assert len(pictures) == 2
    assert validated.model.trained_for() == "epoch 0, step 1"  # the checkpoint's, not the validate run's 0, 0
    # how it samples is not what it learned: another sampler, steps and guidance validate the same checkpoint
    other = cli.main(["validate", *args, "--ckpt_path", ckpt, "--model.init_args.sampler=ddim",
                      "--model.init_args.num_sampling_steps=4", "--model.init_args.guidance_scale=2.0"])
    assert (other.model.hparams.sampler, other.model.hparams.num_sampling_steps) == ("ddim", 4)
    assert other.model.hparams.guidance_scale == 2.0
    assert "ddim, 4 steps, guidance 2" in other.model.sample_grid_title("ddim", 4, 2.0, 0)
    # and `shortcutlab sample` draws from it with any of them: one PNG an image, and the grid
    from commands import sample

    sample.main([str(tmp_path), "--sampler", "ddim", "--num-steps", "4", "--guidance-scale", "1.5",
                 "--num-images", "4", "--out", str(tmp_path / "drawn")])
    drawn = sorted(p.name for p in (tmp_path / "drawn").iterdir())
    assert drawn == ["00000_class0.png", "00001_class0.png", "00002_class9.png", "00003_class9.png", "grid.png"]
    # exactly --num-images, also where they do not fill the grid (8: rows of classes 0, 4 and 9, three a row)
    sample.main([str(tmp_path), "--num-steps", "2", "--num-images", "8", "--out", str(tmp_path / "eight")])
    drawn = sorted(p.name for p in (tmp_path / "eight").iterdir() if p.name != "grid.png")
    assert [name.partition("_")[2] for name in drawn] == ["class0.png"] * 3 + ["class4.png"] * 3 + ["class9.png"] * 2


def test_sample_grid_draws_one_class_per_row_with_its_name(monkeypatch):
    from types import SimpleNamespace

    import lightning_mods._generation.samples as samples

    module = diffusion_module(**{**TINY, "num_classes": 10, "class_conditional": True, "num_sample_images": 16,
                                "sampler": "ddim", "num_sampling_steps": 50, "guidance_scale": 2.0})
    assert module.sample_grid_classes(16) == ([0, 3, 6, 9], 4)  # 4 rows spread over 0..9, 4 samples each
    assert module.sample_grid_classes(64) == ([0, 1, 3, 4, 5, 6, 8, 9], 8)  # round(9 * i / 7)
    assert module.sample_grid_classes(144) == (list(range(10)), 15)  # at most the 10 classes
    names = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
    module.trainer = SimpleNamespace(fast_dev_run=False, current_epoch=2, global_step=40,
                                     datamodule=SimpleNamespace(class_names=names))
    # every "sample" is a flat image whose grey level is its label / 10: the rows must read 0, .3, .6, .9
    monkeypatch.setattr(module, "generate_images", lambda n, labels, **kwargs:
                        (labels.float() / 10).view(-1, 1, 1, 1).expand(n, 1, 8, 8))
    logged = {}
    monkeypatch.setattr(samples, "log_picture", lambda trainer, tag, picture: logged.update({tag: picture}))
    module.log_sample_grid()
    ax = logged["diffusion/samples"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["zero", "three", "six", "nine"]
    assert "epoch 2, step 40" in ax.get_title() and "ddim, 50 steps, guidance 2" in ax.get_title()
    grid = np.asarray(ax.images[0].get_array())
    for row, label in enumerate((0, 3, 6, 9)):
        centre = int(ax.get_yticks()[row])
        assert np.allclose(np.unique(grid[centre]), [label / 10, 1.0]), row  # the row's tiles, and white pad
