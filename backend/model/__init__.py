"""The networks and their loading: causal DiT, attention, RoPE, camera features, KV cache, VAE, umT5."""
