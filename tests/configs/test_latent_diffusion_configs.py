"""The latent-diffusion compositions (ImageNet-100 U-ViT-Mid on VAE latents) fit one step and
validate from the checkpoint they wrote, FID included: the latent rows of
tests/configs/test_diffusion_configs.py, in a file of their own so the suite's two workers share them
(narrow by default, at U-ViT-Mid's real size under the ``full_size`` marker)."""
from __future__ import annotations

import pytest

from helpers.composed_configs import sizes
from test_diffusion_configs import LATENT_RUNS, fit_one_step_then_validate, tiny_latents  # noqa: F401 (a fixture)


@pytest.mark.slow
@pytest.mark.parametrize("name, full_size", sizes(LATENT_RUNS))
def test_fit_one_step_then_validate_from_checkpoint(name, full_size, tmp_path, data_root, tiny_latents):  # noqa: F811
    fit_one_step_then_validate(name, full_size, tmp_path, data_root, tiny_latents)
