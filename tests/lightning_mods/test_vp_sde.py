"""U-ViT's continuous VP SDE (noise_process: vp_sde) against a float64 numpy reference written
here from the SDE itself: beta(t) = 0.1 + 19.9 t, alpha(t) = exp(-(0.1 t + 9.95 t^2))."""
import numpy as np
import pytest
import torch

from helpers.diffusion_modules import diffusion_module

TINY = dict(image_size=4, in_chans=1, patch_size=2, embed_dim=16, depth=2, num_heads=2, pixel_mean=[0.5],
            pixel_std=[0.5], zero_init_branches=False, noise_process="vp_sde", sampler="euler_maruyama",
            num_sampling_steps=1000)


def alpha64(t):
    t = np.asarray(t, dtype=np.float64)
    return np.exp(-(0.1 * t + 0.5 * (20.0 - 0.1) * t ** 2))


def beta64(t):
    return 0.1 + (20.0 - 0.1) * np.asarray(t, dtype=np.float64)


def test_forward_marginal_and_loss_match_float64():
    torch.manual_seed(0)
    module = diffusion_module(**TINY)
    x0 = torch.rand(6, 1, 4, 4) * 2 - 1
    seen = {}
    forward = module.network.forward

    def spy(x, t, y=None):
        seen["x"], seen["t"] = x.detach().clone(), t.detach().clone()
        return forward(x, t, y)

    module.network.forward = spy
    loss = module.diffusion_loss(x0, None, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)  # documented order: the noise, then t ~ U(0, 1)
    noise = torch.randn(x0.shape, generator=gen).double().numpy()
    t = torch.rand((6,), generator=gen).double().numpy()
    a = alpha64(t)[:, None, None, None]
    expected_xt = np.sqrt(a) * x0.double().numpy() + np.sqrt(1 - a) * noise
    np.testing.assert_allclose(seen["x"].double().numpy(), expected_xt, atol=1e-6, rtol=0)
    np.testing.assert_allclose(seen["t"].double().numpy(), 999.0 * t, rtol=1e-6)  # U-ViT: nnet(x_t, t * 999)
    with torch.no_grad():
        eps = forward(torch.tensor(expected_xt).float(), torch.tensor(999.0 * t).float()).double().numpy()
    assert loss.item() == pytest.approx(((eps - noise) ** 2).mean(), rel=1e-5)
    # grid index i is time (i + 1) / 1000: the features' noising and the diffusers samplers' betas
    idx = torch.tensor([0, 99, 999])
    x, z = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    a = alpha64((idx.numpy() + 1) / 1000)[:, None, None, None]
    np.testing.assert_allclose(module.add_noise(x, z, idx).double().numpy(),
                               np.sqrt(a) * x.double().numpy() + np.sqrt(1 - a) * z.double().numpy(), atol=1e-6)
    betas = np.array(module.noise_process.config["trained_betas"])
    np.testing.assert_allclose(np.cumprod(1 - betas), alpha64(np.arange(1, 1001) / 1000), rtol=1e-9)


def test_euler_maruyama_steps_by_hand():
    """Three steps: times 1, 0.5005, 0.001 (linspace(1e-3, 1, 3)), then a noise-free step to 0."""
    module = diffusion_module(**{**TINY, "num_sampling_steps": 3})
    calls = []

    def predict(x, t, labels=None, guidance_scale=1.0):  # eps = 0.3 x + 0.1
        calls.append(float(t))
        return 0.3 * x + 0.1

    module.predict_noise = predict
    out = module.sample(2, seed=11).double().numpy()
    gen = torch.Generator().manual_seed(11)  # documented order: x_1, then one draw per noisy step
    x = torch.randn((2, 1, 4, 4), generator=gen).double().numpy()
    draws = [torch.randn((2, 1, 4, 4), generator=gen).double().numpy() for _ in range(2)]
    times = [1.0, 0.5005, 0.001, 0.0]
    for k, (t, s) in enumerate(zip(times[:-1], times[1:])):
        b, std = beta64(t), np.sqrt(1 - alpha64(t))
        score = -(0.3 * x + 0.1) / std
        x = x + (-0.5 * b * x - b * score) * (s - t)
        if s > 0:
            x = x + np.sqrt(b * (t - s)) * draws[k]
    np.testing.assert_allclose(out, x, rtol=1e-5, atol=1e-5)
    assert calls == pytest.approx([999.0, 999.0 * 0.5005, 0.999], rel=1e-6)


@pytest.mark.parametrize("sampler,steps,tolerance", [("euler_maruyama", 1000, 0.03), ("ddpm", 1000, 0.03),
                                                     ("dpmsolver++_singlestep", 50, 0.03)])
def test_samplers_land_on_a_gaussian_data_distribution(sampler, steps, tolerance):
    """Data ~ N(m, s^2) per pixel: the exact eps is sqrt(1 - a) (x - sqrt(a) m) / (a s^2 + 1 - a)."""
    m, s = 0.4, 0.3
    module = diffusion_module(**{**TINY, "sampler": sampler, "num_sampling_steps": steps, "clip_sample": False})

    def exact_noise(x, net_t, labels=None, guidance_scale=1.0):
        a = float(alpha64(float(net_t) / 999.0))
        return (np.sqrt(1 - a) * (x.double() - np.sqrt(a) * m) / (a * s * s + 1 - a)).float()

    module.predict_noise = exact_noise
    samples = module.sample(256, seed=0).double()  # 256 x 16 pixels
    assert samples.mean().item() == pytest.approx(m, abs=tolerance)
    assert samples.std().item() == pytest.approx(s, abs=tolerance)


def test_euler_maruyama_needs_the_vp_sde():
    with pytest.raises(ValueError, match="euler_maruyama"):
        diffusion_module(**{**TINY, "noise_process": "discrete"})
    with pytest.raises(ValueError, match="noise_process"):
        diffusion_module(**{**TINY, "noise_process": "continuous"})
    with pytest.raises(ValueError, match="beta_schedule"):
        diffusion_module(**{**TINY, "beta_schedule": "scaled_linear"})
