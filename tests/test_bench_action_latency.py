"""bench.action_latency's measurement: which block first shows a key change, and when (synthetic events, no server)."""
from __future__ import annotations

import numpy as np
import pytest

from backend.api.controls import integrate
from bench.action_latency import RTP_WRAP, KeyChange, Shown, keys_of_camera, measure, on_screen

pytestmark = pytest.mark.timeout(30)


def test_the_first_block_on_the_new_key_after_the_one_on_screen() -> None:
    shown = [Shown(block, t=float(block), arrived=float(block)) for block in range(10)]  # block k from k seconds
    used = {k: "w" if k < 5 else "j" for k in range(10)} | {7: None}  # block 7 ran on poses, not keys
    mid, at_a_frame, never = KeyChange(2.5, "j"), KeyChange(6.0, "j"), KeyChange(8.2, "w")
    late, exact, missing = measure([mid, at_a_frame, never], shown, used)
    assert (late.shown_block, late.first_block, late.blocks_later) == (2, 5, 3)
    assert late.wall_s == pytest.approx(2.5)
    # A change at the moment a block appears counts from that block (play reads its keys right after writing one).
    assert (exact.shown_block, exact.first_block, exact.wall_s) == (6, 8, pytest.approx(2.0))
    assert (missing.first_block, missing.wall_s, missing.blocks_later) == (None, None, None)
    with pytest.raises(ValueError, match="before the first frame"):
        measure([KeyChange(-1.0, "j")], shown, used)


@pytest.mark.parametrize("keys", ["w", "j", "-", "a", "wl", "sk", "dk", "wai"])
def test_the_keys_are_read_back_from_the_poses_they_made(keys: str) -> None:
    start = integrate(np.eye(4), "wj", 5)[-1]  # anywhere, turned
    assert keys_of_camera(integrate(start, keys, 12)) == ("" if keys == "-" else "".join(sorted(keys)))


def test_poses_that_no_keys_make_read_as_none() -> None:
    poses = integrate(np.eye(4), "w", 12)
    poses[6:, 2, 3] *= 1.5  # the speed changes within the block
    assert keys_of_camera(poses) is None


def test_a_block_queued_before_the_change_does_not_show_it() -> None:
    """A page's frame queue: blocks 3-5 (on J from an earlier change) had arrived before the change back to J at
    3.5 s but are drawn later; the first block that can show the change is block 8, the next one on J."""
    arrived = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5]
    shown = [Shown(block, t=block + 1.0, arrived=arrived[block]) for block in range(10)]
    used = {0: "w", 1: "w", 2: "w", 3: "j", 4: "j", 5: "j", 6: "w", 7: "w", 8: "j", 9: "j"}
    (latency,) = measure([KeyChange(3.5, "j")], shown, used)
    assert (latency.shown_block, latency.first_block, latency.wall_s) == (2, 8, pytest.approx(5.5))


def test_a_block_is_on_the_video_from_its_first_frame_shown() -> None:
    """WebRTC: block k's first frame has RTP timestamp origin + pts(k) (the origin unknown to the page, here one
    that wraps past 2^32; a pts is the wall time the frame went out, never spaced evenly to the tick); a block whose
    first frame the browser did not show is on screen from its next frame shown."""
    origin, rng = RTP_WRAP - 3 * 5625, np.random.default_rng(0)
    pts = np.cumsum(5625 + rng.integers(-90, 90, 36)) - 5625
    on_air = [{"block": k, "pts": int(pts[12 * k]), "t": pts[12 * k] / 90 + 5.0} for k in range(3)]
    frames = [{"rtp": int(origin + p) % RTP_WRAP, "t": p / 90 + 80.0} for i, p in enumerate(pts) if i != 12]
    shown = on_screen(on_air, frames)
    assert [block for block, _ in shown] == [0, 1, 2]
    assert [t for _, t in shown] == pytest.approx([(pts[0] / 90 + 80) / 1000, (pts[13] / 90 + 80) / 1000,
                                                   (pts[24] / 90 + 80) / 1000])
    assert on_screen(on_air, []) == []
