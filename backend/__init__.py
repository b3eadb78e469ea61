"""Serving engine for a LingBot-World-style causal AR-diffusion video DiT with Ulysses sequence parallelism.

Kept free of heavy imports: `backend.protocol` is used by the client without torch.
"""
