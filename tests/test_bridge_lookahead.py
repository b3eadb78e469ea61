"""The browser bridge's --lookahead: a page session keeps that many steps ahead of the block it waits for, as
`python -m client play` does (no server: a stand-in steered session counts what was sent and answered)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from backend.api.codec import BlockResponse, BlockUsed
from backend.api.request import SessionRequest
from client.web import bridge, serve
from client.web.bridge import Player

pytestmark = pytest.mark.timeout(30)

SETTINGS = "block_frames=3;denoise_steps=4;dtype=float32;sink_frames=3;timestep_shift=5.0;window_frames=9"
BLOCKS = 5


class CountingSession:
    """Answers each request with a block, in order; records how many requests were unanswered at every wait."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.sent_s: list[float] = []
        self.in_flight: list[int] = []
        self.answered_sent_s = 0.0

    def start(self, request: SessionRequest) -> None:
        self.sent_s.append(0.0)

    def step(self, controls, end: bool = False, save: bool = False) -> None:
        self.sent_s.append(float(len(self.sent_s)))

    def waiting_since(self) -> float | None:
        return None

    def end(self) -> None:
        pass

    def next_block(self, timeout: float | None = None) -> BlockResponse | None:
        received = len(self.in_flight)
        self.in_flight.append(len(self.sent_s) - received)
        if received == BLOCKS:
            return None
        frames = 9 if received == 0 else 12
        camera = np.tile(np.eye(4, dtype=np.float32), (frames, 1, 1))
        return BlockResponse(received, 0, None, np.zeros((frames, 16, 16, 3), np.uint8), (), float(received), False,
                             BlockUsed(camera, "a street", f"{received:064x}", SETTINGS if received == 0 else None))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_a_page_keeps_lookahead_steps_ahead(lookahead: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sessions: list[CountingSession] = []
    monkeypatch.setattr(bridge, "SteeredSession", lambda *a, **k: sessions.append(CountingSession()) or sessions[-1])
    messages: list = []

    async def send(message) -> None:
        messages.append(message)

    player = Player("unused:8001", "lingbot_world", tmp_path / "page.mp4", send, timeout=5, lookahead=lookahead,
                    save_every=0)
    player.hold("w")
    request = bridge.start_request({"prompt": "a street", "height": 16, "width": 16, "keys": "w"})
    asyncio.run(player.play(request))
    assert messages[-1]["type"] == "ended", messages[-1]
    # Waiting for each block, the session has that block's request and `lookahead` more unanswered.
    assert sessions[0].in_flight[:BLOCKS] == [lookahead + 1] * BLOCKS
    assert [m["index"] for m in messages if isinstance(m, dict) and m["type"] == "block"] == list(range(BLOCKS))


def test_serve_takes_lookahead_zero_and_refuses_a_negative_one(capsys: pytest.CaptureFixture) -> None:
    assert serve.parse_args(["--lookahead", "0"]).lookahead == 0
    assert serve.parse_args([]).lookahead == 1
    with pytest.raises(SystemExit):
        serve.parse_args(["--lookahead", "-1"])
    assert "argument --lookahead: must be 0 or more, got -1" in capsys.readouterr().err
