"""The real-time factor shown by `client play` and the player: seconds of video per second of delivery."""
from __future__ import annotations

import pytest

from client.pace import DeliveryRate


def test_steady_blocks_give_play_time_over_the_block_interval() -> None:
    rate = DeliveryRate(fps=16)
    assert rate.add(9, arrival_s=30.0) is None  # the first block: start-up, no rate yet
    # lookahead 1: each step's latency spans two block intervals, the rate must not be halved by it
    factors = [rate.add(12, arrival_s=30.0 + 0.5 * k) for k in range(1, 5)]
    assert factors == pytest.approx([12 / 16 / 0.5] * 4)


def test_a_slow_server_reads_below_one() -> None:
    rate = DeliveryRate(fps=16)
    rate.add(9, 0.0)
    assert rate.add(12, 1.5) == pytest.approx(0.5)
    assert rate.add(12, 2.0) == pytest.approx(24 / 16 / 2.0)
