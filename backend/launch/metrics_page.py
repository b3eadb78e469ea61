"""A server's Prometheus text page (its metrics port): reading it, and one metric's samples by their labels."""
from __future__ import annotations

import urllib.request


def metrics_page(url: str, timeout_s: float) -> str:
    """The text at `url` (http://HOST:METRICS_PORT/metrics); OSError when it cannot be read."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.read().decode(errors="replace")


def samples(page: str, metric: str, **labels: str) -> list[float]:
    """The values of `metric`'s samples that carry each of `labels` (name="value"), in the page's order."""
    wanted = [f'{name}="{value}"' for name, value in labels.items()]
    return [float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
            if line.startswith(metric + "{") and all(w in line for w in wanted)]
