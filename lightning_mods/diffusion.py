"""Noise-prediction diffusion with a decayed-shortcut U-ViT (the decay paper, section 5; "Residual
Connections Harm Generative Representation Learning", section 5; Bao et al. 2023).

Training: ``x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps`` with ``t`` uniform over the
training timesteps (``noise_process: discrete``) or over ``[0, 1]`` on U-ViT's continuous VP SDE
(``vp_sde``, network input ``t * 999``), and the loss ``|| eps_theta(x_t, t, y) - eps ||^2``.
Class-conditional models replace the label by the null class with probability ``label_dropout`` and sample with
classifier-free guidance ``eps_u + guidance_scale * (eps_c - eps_u)`` (1 = no guidance;
U-ViT's "scale 0.4" is 1.4 here). Samplers: :mod:`lightning_mods._generation.sampling`.

Pixel mode: the datamodule's normalised images are mapped back to ``[-1, 1]``. Latent mode
(``vae_path``): the batches are VAE latents already (``datamodules.latents.Latents``) and
samples are decoded by the frozen VAE for pictures and FID.

EMA weights come from ``callbacks.training.ema.EMA`` (Lightning's ``EMAWeightAveraging``), which swaps them in for the
whole validation epoch. The sample grid is therefore drawn in ``on_validation_epoch_start``:
the module's hook runs after every callback's, so after the swap (its ``on_validation_epoch_end``
would run after the callbacks swap the training weights back).

Evaluation features (docs/contracts.md): the input noised to ``feature_timestep``, the tokens of
block ``feature_block`` (depth order in -> mid -> out), mean over patch tokens; class-conditional
models see the null class so no label leaks into the features.
"""
from __future__ import annotations

import math
from typing import Literal, Optional, Sequence, Union

import torch
from torchmetrics import MeanMetric
import torch.nn.functional as F
from lightning.pytorch import LightningModule

from lightning_mods.evaluation import metric_names
from lightning_mods._generation.sampling import check_sampler, make_noise_process
from lightning_mods._generation.guidance import drop_labels
from lightning_mods._generation.diffusion_settings import check_conditioning, check_settings, latent_vae, middle_block
from lightning_mods._generation.latent_vae import FrozenVAE
from lightning_mods._generation.samples import Samples
from lightning_mods.recipe.optim import adamw, global_batch_size, param_groups_weight_decay, scaled_lr, warmup_cosine_scheduler
from lightning_mods.checkpointing.earlier_releases import ReadsEarlierReleases
from lightning_mods.checkpointing.network_settings import given_network, network_settings
from lightning_mods.backbone.uvit import UViT
from lightning_mods.evaluation._distributed_eval import ExactEvaluation
from lightning_mods.evaluation.feature_contract import Indices, take_indices
from lightning_mods.evaluation._input_geometry import check_input_geometry


class DiffusionModule(ReadsEarlierReleases, Samples, ExactEvaluation, LightningModule):
    """U-ViT noise-prediction diffusion, pixel or latent, unconditional or class-conditional.

    Extension points: :meth:`corrupt` (the noise process of training), :meth:`loss_weight`
    (the loss weighting over time) and :meth:`condition` (the conditioning input).

    Args:
        network: the :class:`~lightning_mods.backbone.uvit.UViT` to train (its architecture and
            shortcut schedule over all blocks in, mid and out): ``class_path``/``init_args`` in a
            config (its ``img_size``, ``in_chans`` and, class-conditional, ``num_classes`` set from the
            datamodule by the CLI: the latent size and channels in latent mode), a registered timm
            name, or a module.
        num_classes: the data's classes (linked from the datamodule by the CLI).
        class_conditional: condition on the labels (the network embeds ``num_classes`` classes +
            a null class).
        noise_process: ``discrete`` (DDPM) or ``vp_sde`` (U-ViT's continuous VP SDE, see
            :mod:`lightning_mods._generation.sampling`).
        num_train_timesteps, beta_schedule, beta_start, beta_end: the noise schedule (``vp_sde``:
            linear, ``beta(t)`` from ``num_train_timesteps * beta_start`` to ``... * beta_end``).
        sampler: ``ddpm`` (ancestral), ``ddim``, ``dpmsolver++`` (multistep, order 2),
            ``dpmsolver++_singlestep`` (order 3) or ``euler_maruyama`` (``vp_sde`` only);
            ``num_sampling_steps`` steps.
        guidance_scale: classifier-free guidance at sampling (1 = none).
        label_dropout: probability of training a sample with the null class.
        clip_sample: clip the predicted ``x_0`` to [-1, 1] in DDPM/DDIM (None: pixel mode only).
        vae_path: local ``AutoencoderKL`` folder; set = latent mode.
        latent_scaling_factor: latent scale (None: the VAE config's).
        pixel_mean, pixel_std: the datamodule's normalisation (None: read from the datamodule in
            ``setup`` and recorded here, so checkpoints carry it).
        lr: peak AdamW learning rate (for ``reference_batch`` samples when that is set: then the
            peak is ``lr * global batch / reference_batch``).
        weight_decay, betas: AdamW.
        decay_all_parameters: decay every parameter as U-ViT does; ``False``: no decay on norms,
            biases, position and class embeddings (:func:`~lightning_mods.recipe.optim.param_groups_weight_decay`).
        warmup_steps: linear warm-up in optimiser steps, then ``lr_schedule``: ``constant``
            (U-ViT) or ``cosine`` to ``min_lr_ratio * peak``.
        num_sample_images, sample_seed: the sample grid drawn at every validation.
        feature_block, feature_timestep, feature_seed: evaluation features (default block: the
            mid block).
    """

    network_is_evaluated = False  # its features: the network's blocks at a noise level of its own process
    # how it samples, not what it learned: a checkpoint is validated or sampled with any of these
    inference_settings = ("sampler", "num_sampling_steps", "guidance_scale", "num_sample_images", "sample_seed")

    def __init__(
        self,
        network: Union[UViT, str], num_classes: int = 0, class_conditional: bool = False,
        # the noise process and the sampler
        noise_process: Literal["discrete", "vp_sde"] = "discrete", num_train_timesteps: int = 1000,
        beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2"] = "linear",
        beta_start: float = 1e-4, beta_end: float = 0.02,
        sampler: Literal["ddpm", "ddim", "dpmsolver++", "dpmsolver++_singlestep", "euler_maruyama"] = "ddpm",
        num_sampling_steps: int = 1000, guidance_scale: float = 1.0, label_dropout: float = 0.1,
        clip_sample: Optional[bool] = None,
        # latent mode and pixel statistics
        vae_path: Optional[str] = None, latent_scaling_factor: Optional[float] = None,
        pixel_mean: Optional[Sequence[float]] = None, pixel_std: Optional[Sequence[float]] = None,
        # the optimiser and its schedule
        lr: float = 2e-4, reference_batch: Optional[int] = None, weight_decay: float = 0.03,
        decay_all_parameters: bool = False, betas: tuple[float, float] = (0.99, 0.999), warmup_steps: int = 2500,
        lr_schedule: Literal["constant", "cosine"] = "constant", min_lr_ratio: float = 0.0,
        # pictures and evaluation features
        num_sample_images: int = 16, sample_seed: int = 0, feature_block: Optional[int] = None,
        feature_timestep: int = 100, feature_seed: int = 0,
    ) -> None:
        super().__init__()
        self.network = given_network(network, UViT, "DiffusionModule", "uvit_small_patch2_32_decayed")
        check_settings(class_conditional, num_classes, label_dropout, guidance_scale, lr_schedule, reference_batch,
                       num_sample_images, feature_timestep, num_train_timesteps, self.network.in_chans, pixel_mean,
                       pixel_std)
        check_conditioning(self.network, class_conditional, num_classes)
        self.noise_process = make_noise_process(noise_process, num_train_timesteps, beta_schedule, beta_start,
                                                beta_end)
        check_sampler(sampler, num_sampling_steps, num_train_timesteps, noise_process)
        self.save_hyperparameters(ignore=["network"])
        # the resolved settings of the network (plain data), so a checkpoint rebuilds this very network
        self.hparams["network"] = self._hparams_initial["network"] = network_settings(self.network)
        self._pixel_stats_cache: Optional[tuple] = None  # (key, mean, std) on the last device used
        self.vae: Optional[FrozenVAE] = None if vae_path is None else latent_vae(vae_path, latent_scaling_factor,
                                                                                 self.network.in_chans)
        self.clip_sample = (self.vae is None) if clip_sample is None else bool(clip_sample)
        self.feature_block = middle_block(self.network.num_blocks, feature_block)
        self.num_features = self.network.embed_dim
        self.val_loss_mean = MeanMetric()  # each validation image once, also under DDP

    # --- data space ------------------------------------------------------------------------
    @property
    def is_latent(self) -> bool:
        return self.vae is not None

    @property
    def class_conditional(self) -> bool:
        return bool(self.hparams.class_conditional)

    def set_pixel_stats(self, datamodule) -> None:  # noqa: ANN001 (any datamodule with mean/std)
        """Record the datamodule's normalisation (pixel mode) unless given at construction."""
        if self.is_latent:
            expected = getattr(datamodule, "scaling_factor", None)
            if expected is not None and not math.isclose(float(expected), self.vae.scaling_factor, rel_tol=1e-6):
                raise ValueError(f"latent_scaling_factor: the model decodes with {self.vae.scaling_factor} but the "
                                 f"latents were scaled by {expected}; set latent_scaling_factor={expected}")
            shift = getattr(datamodule, "shift_factor", None)
            if shift is not None and not math.isclose(float(shift), self.vae.shift_factor, rel_tol=1e-6, abs_tol=1e-9):
                raise ValueError(f"vae_path: this VAE shifts latents by {self.vae.shift_factor} but the latents were "
                                 f"shifted by {shift}; decode with the VAE that encoded them")
            return
        for field, attribute in (("pixel_mean", "mean"), ("pixel_std", "std")):
            if self.hparams[field] is None and getattr(datamodule, attribute, None) is not None:
                self.hparams[field] = [float(v) for v in getattr(datamodule, attribute)]

    def _pixel_stats(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.network.in_chans
        mean = self.hparams.pixel_mean if self.hparams.pixel_mean is not None else [0.5] * c
        std = self.hparams.pixel_std if self.hparams.pixel_std is not None else [0.5] * c
        key = (device, tuple(mean), tuple(std))
        if self._pixel_stats_cache is None or self._pixel_stats_cache[0] != key:  # no host-to-device copy per step
            self._pixel_stats_cache = (key, torch.tensor(mean, device=device).view(1, -1, 1, 1),
                                       torch.tensor(std, device=device).view(1, -1, 1, 1))
        return self._pixel_stats_cache[1], self._pixel_stats_cache[2]

    def to_model_space(self, images: torch.Tensor) -> torch.Tensor:
        """Datamodule batch -> diffusion space: ``[-1, 1]`` pixels, or the latents as they are."""
        if self.is_latent:
            return images
        mean, std = self._pixel_stats(images.device)
        return (images * std + mean) * 2.0 - 1.0

    def to_pixels(self, samples: torch.Tensor) -> torch.Tensor:
        """Diffusion space -> ``[0, 1]`` images (decoded by the VAE in latent mode)."""
        pixels = self.vae.decode(samples) if self.is_latent else samples.float()
        return ((pixels + 1.0) * 0.5).clamp(0.0, 1.0)

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        check_input_geometry(self.network, datamodule, "DiffusionModule",
                             "give the network the data's img_size and in_chans, or data of the network's")
        if datamodule is not None:
            self.set_pixel_stats(datamodule)

    # --- the model -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Predicted noise ``eps_theta(x_t, t, y)``."""
        return self.network(x, timesteps, y)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """``sqrt(abar_t) x_0 + sqrt(1 - abar_t) noise`` at integer ``timesteps`` of the grid (``vp_sde``:
        the continuous times ``(timesteps + 1) / num_train_timesteps``)."""
        return self.noise_process.add_noise(x0, noise, self.noise_process.grid_time(timesteps))

    def grid_network_time(self, timesteps: torch.Tensor) -> torch.Tensor:
        """The network's time input at integer ``timesteps`` of the grid."""
        return self.noise_process.network_time(self.noise_process.grid_time(timesteps))

    def diffusion_loss(self, x0: torch.Tensor, labels: Optional[torch.Tensor],
                       generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Noise-prediction MSE (:meth:`corrupt`, weighted over time by :meth:`loss_weight`)."""
        x_t, t, noise = self.corrupt(x0, generator)
        return self.noised_loss(x_t, t, noise, labels)

    def noised_loss(self, x_t: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
                    labels: Optional[torch.Tensor]) -> torch.Tensor:
        """The loss of :meth:`diffusion_loss` on inputs already noised (:meth:`corrupt`'s output)."""
        predicted = self(x_t, self.noise_process.network_time(t), labels).float()
        weight = self.loss_weight(t)
        if weight is None:
            return F.mse_loss(predicted, noise.float())
        per_sample = (predicted - noise.float()).pow(2).flatten(1).mean(dim=1)
        return (per_sample * weight.to(per_sample)).mean()

    def corrupt(self, x0: torch.Tensor, generator: Optional[torch.Generator] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Extension point: the forward noise process of training. Returns ``(x_t, t, noise)``:
        the noised inputs, their times in the process's units (``noise_process.network_time(t)`` is
        what the network sees) and the noise it learns to predict. Default: Gaussian noise, then
        uniform times of ``noise_process`` (``generator``: a CPU generator, else the global RNG).
        Sampling runs the configured ``noise_process``'s sampler: a corruption of one's own that
        changes the marginals of ``x_t`` needs a sampler to match."""
        if generator is None:
            noise = torch.randn_like(x0)
        else:
            noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
        t = self.noise_process.draw_times(x0.shape[0], generator, x0.device)
        return self.noise_process.add_noise(x0, noise, t), t, noise

    def loss_weight(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """Extension point: the weight of each sample's loss at its time ``t`` (shape ``B``); the
        loss is then the mean of weight x per-sample MSE. Default None: the plain MSE (every time
        weighted 1)."""
        return None

    def condition(self, labels: torch.Tensor, dropout: float,
                  generator: Optional[torch.Generator] = None) -> Optional[torch.Tensor]:
        """Extension point: the network's conditioning input from a batch's labels (None: none).
        Default: the class labels, each replaced by the null class with probability ``dropout``
        (classifier-free guidance) for a class-conditional model; None otherwise."""
        if not self.class_conditional:
            return None
        return drop_labels(labels.long(), dropout, self.network.null_class, generator)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch[0], batch[1]
        loss = self.diffusion_loss(self.to_model_space(images), self.condition(labels, self.hparams.label_dropout))
        # no prog_bar: Lightning reads prog_bar values to the host after every step (a GPU sync);
        # callbacks/reporting/progress_bar.py shows the loss at the logging cadence
        self.log(metric_names.TRAIN_LOSS, loss, on_step=True, on_epoch=True, batch_size=images.shape[0])
        return loss

    def validation_step(self, batch, batch_idx: int) -> Optional[torch.Tensor]:
        # the images a DDP sampler repeats are left out, and the batch means weighted by their
        # images: the epoch value is the mean over the validation set, whatever the world size
        # and each image's noise, time and label drop drawn from a generator seeded with its dataset
        # index: fixed per image (comparable between epochs), the same under any world size
        indices = self.sample_indices(len(batch[0]), batch_idx)
        count, images, labels, indices = self.without_repeats(batch_idx, batch[0], batch[1], indices)
        loss = None
        if count:
            x0 = self.to_model_space(images)
            drawn = []
            for i, index in enumerate(indices.tolist()):
                generator = torch.Generator().manual_seed(1234 + index)
                y = self.condition(labels[i:i + 1], self.hparams.label_dropout, generator)
                drawn.append((y, *self.corrupt(x0[i:i + 1], generator)))
            ys, x_t, t, noise = zip(*drawn)
            y = None if ys[0] is None else torch.cat(ys)
            loss = self.noised_loss(torch.cat(x_t), torch.cat(t), torch.cat(noise), y)
            self.val_loss_mean.update(loss, weight=count)
        self.log(metric_names.VAL_LOSS, self.val_loss_mean, prog_bar=True, batch_size=count)
        return loss

    def on_validation_epoch_start(self) -> None:
        # after the callbacks' hooks: EMAWeightAveraging has swapped the averaged weights in
        if self.trainer.sanity_checking or self.hparams.num_sample_images <= 0:
            return
        self.log_sample_grid()

    # --- evaluation features ---------------------------------------------------------------
    @torch.no_grad()
    def noised_block_features(self, images: torch.Tensor, blocks: Sequence[int],
                              timestep: Optional[int] = None, seed: Optional[int] = None) -> list[torch.Tensor]:
        """Patch-token means ``B x D`` of ``blocks`` for ``images`` noised to ``timestep``."""
        t = self.hparams.feature_timestep if timestep is None else int(timestep)
        if not 0 <= t < self.hparams.num_train_timesteps:
            raise ValueError(f"timestep must be in [0, {self.hparams.num_train_timesteps - 1}], got {t}")
        bad = [b for b in blocks if not 0 <= b < self.network.num_blocks]
        if bad:
            raise ValueError(f"blocks must be in [0, {self.network.num_blocks - 1}], got {bad}")
        x0 = self.to_model_space(images)
        generator = torch.Generator().manual_seed(self.hparams.feature_seed if seed is None else int(seed))
        noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype).to(x0.device)
        timesteps = torch.full((x0.shape[0],), t, dtype=torch.long, device=x0.device)
        outputs = self.network.forward_blocks(self.add_noise(x0, noise, timesteps), self.grid_network_time(timesteps),
                                            None, num_blocks=max(blocks) + 1)
        prefix = self.network.num_prefix_tokens
        return [outputs[b][:, prefix:].mean(dim=1) for b in blocks]

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """``B x D``: block ``feature_block`` at ``feature_timestep``, mean over patch tokens."""
        return self.noised_block_features(images, [self.feature_block])[0]

    def forward_intermediates(self, images: torch.Tensor, indices: Indices = None, intermediates_only: bool = False):
        """``(forward_features, one pooled feature per block indices picks)``, depth order in ->
        mid -> out, at ``feature_timestep``, from one noised pass (timm's call;
        :mod:`lightning_mods.evaluation.feature_contract`)."""
        taken = take_indices(self.network.num_blocks, indices)
        wanted = taken if intermediates_only else sorted(set(taken) | {self.feature_block})
        outputs = dict(zip(wanted, self.noised_block_features(images, wanted)))
        blocks = [outputs[b] for b in taken]
        return blocks if intermediates_only else (outputs[self.feature_block], blocks)

    def predict_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        """``embeddings`` (``forward_features``: the probe's noised block features) and ``labels``,
        for ``callbacks.reporting.prediction_writer``."""
        images, labels = batch[0], batch[1]
        return {"embeddings": self.forward_features(images), "labels": labels}

    # --- optimisation ----------------------------------------------------------------------
    def configure_optimizers(self):
        peak = self.hparams.lr
        if self.hparams.reference_batch is not None:
            peak = scaled_lr(peak, global_batch_size(self.trainer),
                             self.hparams.reference_batch)
        if self.hparams.decay_all_parameters:  # U-ViT: AdamW(nnet.parameters(), weight_decay=...)
            groups = [{"params": [p for p in self.network.parameters() if p.requires_grad],
                       "weight_decay": self.hparams.weight_decay}]
        else:
            groups = param_groups_weight_decay(self.network, self.hparams.weight_decay)
        optimizer = adamw(groups, lr=peak, betas=tuple(self.hparams.betas))
        total = int(self.trainer.estimated_stepping_batches)
        warmup = min(self.hparams.warmup_steps, max(0, total - 1))
        # "constant" (U-ViT): the same warm-up, then a "cosine" whose floor is the peak
        floor = self.hparams.min_lr_ratio if self.hparams.lr_schedule == "cosine" else 1.0
        return {"optimizer": optimizer, "lr_scheduler": warmup_cosine_scheduler(optimizer, warmup, total, floor)}
