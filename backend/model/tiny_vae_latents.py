"""The latents the tiny decoder (tiny_vae) reads and the frames it makes of them: torch-free, for the start-up
check of decoder=tiny against a checkpoint's VAE."""

LATENT_CHANNELS = 16  # Wan 2.1's z_dim
SPATIAL_FACTOR = 8  # three 2x upsamples
TIME_FACTOR = 4  # two time grows of stride 2
