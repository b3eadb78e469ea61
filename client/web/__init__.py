"""`python -m client serve`: a browser player that watches and steers sessions as they stream (aiohttp bridge)."""
