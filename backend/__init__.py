"""Serving a LingBot-World-style causal AR-diffusion video DiT on Triton with Ulysses sequence parallelism.

Rooms, each importing only from the rooms listed before it:
`api` (torch-free wire contract, request checks, errors, settings parsing; shared with the client),
`parallel` (process group bootstrap, sequence-parallel exchanges), `model` (the DiT, VAE, text encoder,
checkpoint loading), `engine` (the AR rollout), `serving` (sessions, scheduler, coordinator, decode sender),
then `adapter` (the Triton Python-backend model) and `launch` (config rendering, tritonserver process).
"""
