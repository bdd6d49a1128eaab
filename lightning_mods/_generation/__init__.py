"""The diffusion model's parts that are not the network: the VP SDE (`vp_sde`), its samplers
(`sampling`), the frozen latent-diffusion VAE (`latent_vae`) and the image sets FID reads (`fid`)."""
