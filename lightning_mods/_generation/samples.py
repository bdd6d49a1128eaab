"""The diffusion model's samples: its samplers run with classifier-free guidance, and the sample
grid, one class per row (spread over the classes), named by the datamodule's class names, drawn
each validation from the weights in use (the EMA's)."""
from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Optional, Sequence

import numpy as np
import torch

from lightning_mods.evaluation._eval_mode import isolated_eval
from lightning_mods._generation.guidance import guided_noise
from lightning_mods._generation.sampling import check_sampler, make_sampler, run_sampler
from lightning_mods._generation.vp_sde import euler_maruyama
from lightning_mods.pictures.grids import labelled_grid, log_picture


class Samples:
    """Mixin of :class:`lightning_mods.diffusion.DiffusionModule`: sampling, the sample grid and
    the balanced labels FID samples with. Reads the module's ``hparams``, ``network``,
    ``noise_process``, ``class_conditional``, ``is_latent``, ``clip_sample``,
    ``grid_network_time`` and ``to_pixels``."""

    # --- sampling --------------------------------------------------------------------------
    def _forward_context(self) -> contextlib.AbstractContextManager:
        trainer = self._trainer
        return trainer.precision_plugin.forward_context() if trainer is not None else contextlib.nullcontext()

    def predict_noise(self, x: torch.Tensor, t: torch.Tensor, labels: Optional[torch.Tensor],
                      guidance_scale: float) -> torch.Tensor:
        """``eps`` at network time ``t`` (a scalar), with classifier-free guidance for labelled samples."""
        timesteps = t.to(x.device).expand(x.shape[0])
        if labels is None or not self.class_conditional or guidance_scale == 1.0:
            return self.network(x, timesteps, labels if self.class_conditional else None).float()
        null = torch.full_like(labels, self.network.null_class)
        eps = self.network(torch.cat([x, x]), torch.cat([timesteps, timesteps]), torch.cat([labels, null])).float()
        eps_cond, eps_uncond = eps.chunk(2)
        return guided_noise(eps_cond, eps_uncond, guidance_scale)

    @torch.no_grad()
    def sample(self, num_samples: int, labels: Optional[torch.Tensor] = None, seed: int = 0,
               sampler: Optional[str] = None, num_steps: Optional[int] = None,
               guidance_scale: Optional[float] = None) -> torch.Tensor:
        """Samples in diffusion space (pixels in [-1, 1] or latents), ``N x C x H x W``.

        ``labels=None`` samples unconditionally (the null class for a class-conditional model).
        Deterministic for a given ``seed``: the generator lives on the CPU. DDPM and DDIM clip
        their predicted ``x0`` to ``[-1, 1]`` in pixel mode; DPM-Solver++ and Euler-Maruyama do
        not, so an untrained model's samples can leave that range (``to_pixels`` clamps them).
        """
        sampler = sampler or self.hparams.sampler
        num_steps = num_steps or self.hparams.num_sampling_steps
        scale = self.hparams.guidance_scale if guidance_scale is None else guidance_scale
        check_sampler(sampler, num_steps, self.hparams.num_train_timesteps, self.noise_process.name)
        if labels is not None:
            if not self.class_conditional:
                raise ValueError("labels: this model is unconditional (class_conditional=False)")
            labels = labels.to(self.device).long()
            if labels.shape != (num_samples,):
                raise ValueError(f"labels must have shape ({num_samples},), got {tuple(labels.shape)}")
        generator = torch.Generator().manual_seed(int(seed))
        shape = (num_samples, self.network.in_chans, self.network.img_size, self.network.img_size)
        noise = torch.randn(shape, generator=generator).to(self.device)
        predict = partial(self.predict_noise, labels=labels, guidance_scale=scale)
        process = self.noise_process
        with isolated_eval(self), self._forward_context():
            if sampler == "euler_maruyama":
                return euler_maruyama(lambda x, t: predict(x, process.network_time(t)), process.sde, noise,
                                      num_steps, generator)
            scheduler = make_sampler(sampler, process.config, self.clip_sample)
            return run_sampler(lambda x, i: predict(x, self.grid_network_time(i)), noise, scheduler, num_steps,
                               generator)

    @torch.no_grad()
    def generate_images(self, num_samples: int, labels: Optional[torch.Tensor] = None, seed: int = 0,
                        sampler: Optional[str] = None, num_steps: Optional[int] = None,
                        guidance_scale: Optional[float] = None) -> torch.Tensor:
        """``N x C x H x W`` images in [0, 1] (decoded by the VAE in latent mode)."""
        samples = self.sample(num_samples, labels, seed, sampler, num_steps, guidance_scale)
        return self.to_pixels(samples)

    def grid_labels(self, num_samples: int, start: int = 0) -> Optional[torch.Tensor]:
        """Labels ``start, start + 1, ...`` modulo the number of classes (balanced classes, the FID
        sample set of ``callbacks.measurement.fid``) for a class-conditional model, else ``None``."""
        if not self.class_conditional:
            return None
        return torch.arange(start, start + num_samples, device=self.device) % self.hparams.num_classes

    def sample_grid_classes(self, num_samples: int) -> tuple[Optional[list[int]], int]:
        """The sample grid's layout: ``(classes, columns)``, one class per row, about
        ``num_samples`` images in a near-square grid; the classes spread evenly over all of them
        (digits, 16 images: 0, 3, 6, 9, four samples each). Unconditional: ``(None, columns)``."""
        rows = max(1, math.ceil(math.sqrt(num_samples)))
        if not self.class_conditional:
            return None, rows
        rows = min(rows, self.hparams.num_classes)
        classes = np.unique(np.linspace(0, self.hparams.num_classes - 1, rows).round().astype(int)).tolist()
        return classes, max(1, math.ceil(num_samples / len(classes)))

    def class_names(self) -> Optional[Sequence[str]]:
        """The datamodule's ``class_names`` when it has them (e.g. CIFAR-10), else ``None``."""
        names = getattr(getattr(self._trainer, "datamodule", None), "class_names", None)  # none outside a Trainer
        return list(names) if names is not None and len(names) == self.hparams.num_classes else None

    def trained_for(self) -> str:
        """``epoch E, step S`` of the weights sampled: the fit's position while fitting, else the
        checkpoint's that was loaded (``validate --ckpt_path``, ``shortcutlab sample``)."""
        trainer = self._trainer
        fitting = trainer is not None and getattr(getattr(trainer, "state", None), "fn", None) == "fit"
        loaded = getattr(self, "_checkpoint_at", None)
        if loaded is not None and not fitting:
            return f"epoch {loaded[0]}, step {loaded[1]}"
        return f"epoch {self.current_epoch}, step {self.global_step}"

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.note_checkpoint_position(checkpoint)

    def note_checkpoint_position(self, checkpoint: dict) -> None:
        """Remember the epoch and step of the checkpoint the weights came from (:meth:`trained_for`)."""
        self._checkpoint_at = (checkpoint.get("epoch", "?"), checkpoint.get("global_step", "?"))

    def sample_grid_title(self, sampler: str, num_steps: int, guidance_scale: float, seed: int) -> str:
        space = "latent" if self.is_latent else "pixel"
        kind = "one row a class, spread over the classes" if self.class_conditional else "unconditional"
        guidance = f", guidance {guidance_scale:g}" if self.class_conditional else ""
        return (f"{type(self).__name__} ({space} U-ViT) samples, {self.trained_for()}\n"
                f"{sampler}, {num_steps} steps{guidance}, seed {seed}; {kind}")

    def sample_grid(self, num_images: int, seed: int, sampler: Optional[str] = None, num_steps: Optional[int] = None,
                    guidance_scale: Optional[float] = None) -> tuple:
        """``(figure, images N x C x H x W in [0, 1], labels or None)``: exactly ``num_images`` samples
        in a near-square grid, one row a class (:meth:`sample_grid_classes`) for a class-conditional
        model (the last row short when they do not fill it), titled with what drew them; the
        settings default to the model's."""
        hp = self.hparams
        sampler, num_steps = sampler or hp.sampler, num_steps or hp.num_sampling_steps
        scale = hp.guidance_scale if guidance_scale is None else guidance_scale
        classes, cols = self.sample_grid_classes(num_images)
        rows = len(classes) if classes is not None else math.ceil(num_images / cols)
        labels = None if classes is None else \
            torch.tensor(classes, device=self.device).repeat_interleave(cols)[:num_images]
        images = self.generate_images(num_images, labels, seed=seed, sampler=sampler, num_steps=num_steps,
                                      guidance_scale=scale)
        drawn = images.permute(0, 2, 3, 1).float().cpu().numpy()
        tiles = np.ones((rows * cols, *drawn.shape[1:]), dtype=np.float32)  # white where the last row ends
        tiles[:num_images] = drawn
        tiles = tiles.reshape(rows, cols, *drawn.shape[1:])
        names = self.class_names()
        row_labels = None if classes is None else [names[c] if names else f"class {c}" for c in classes]
        title = self.sample_grid_title(sampler, num_steps, scale, seed)
        return labelled_grid(tiles, title, row_labels=row_labels), images, labels

    def log_sample_grid(self) -> None:
        n, steps = self.hparams.num_sample_images, self.hparams.num_sampling_steps
        if self.trainer.fast_dev_run:  # a code check: 4 images, 2 steps (1000 steps of U-ViT-S are minutes on a CPU)
            n, steps = min(n, 4), min(2, steps)
        figure, _, _ = self.sample_grid(n, self.hparams.sample_seed, num_steps=steps)
        log_picture(self.trainer, "diffusion/samples", figure)
