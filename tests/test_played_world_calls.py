"""What a caller of client/world.PlayedWorld sees without a failover, as the page's bridge plays it: a save asked
for, each outcome told as the blocks come, the end read from next_block, its place in the queue. Against
test_played_world.py's stand-in server."""
from __future__ import annotations

import numpy as np
import pytest

from backend.api.codec import Place
from backend.api.request import Controls, SessionRequest
from client.world import PlayedWorld, Saved
from test_played_world import StandIn

pytestmark = pytest.mark.timeout(30)


def started(server: StandIn, told: list[Saved], save_every: int, **options: object) -> PlayedWorld:
    world = PlayedWorld("stand-in:8001", save_every=save_every, on_snapshot=told.append,
                        **{"session_factory": server.session, **options})
    world.start(SessionRequest(image=np.zeros((8, 8, 3), np.uint8), prompt="a street", poses=None, num_frames=None,
                               seed=1, height=8, width=8, keys="w"))
    return world


def test_a_save_asked_for_follows_the_next_step_s_block_and_is_told_on_the_next_call() -> None:
    server, told = StandIn(), []
    world = started(server, told, save_every=0)
    assert world.next_block(5).block_index == 0 and world.step_latency_s >= 0
    world.save()
    world.step(Controls(keys="a"))
    world.step(Controls(keys="s"))
    assert world.next_block(5).block_index == 1 and told == []  # told on the caller's thread, at its next call
    assert world.next_block(5).block_index == 2
    (saved,) = told
    assert (saved.block_index, saved.asked, saved.error) == (1, True, None) and saved.snapshot_id in server.store
    world.finish(5)
    assert len(told) == 1


def test_a_world_ended_on_a_step_that_saves_ends_in_next_block_after_that_block_and_its_save() -> None:
    server, told = StandIn(), []
    world = started(server, told, save_every=2)
    world.step(Controls(keys="a"), end=True)  # block 1 saves: the end goes alone once its block came
    assert [world.next_block(5).block_index for _ in range(2)] == [0, 1]
    assert world.next_block(5) is None
    assert [(s.block_index, s.asked) for s in told] == [(1, False)]


def test_a_world_ended_with_every_block_read_ends_in_next_block_at_once() -> None:
    """As the page's stop: end() after the last block read, then next_block until None."""
    server, told = StandIn(), []
    world = started(server, told, save_every=0)
    world.step(Controls(keys="a"))
    assert [world.next_block(5).block_index for _ in range(2)] == [0, 1]
    world.end()
    assert world.next_block(5) is None


def test_on_place_hears_each_place_in_the_queue_and_nothing_else() -> None:
    server, places = StandIn(), []

    def session_in_line(*args: object, **kwargs: object):
        session = server.session(*args, **kwargs)
        kwargs["on_place"](Place(1, 0.5))  # as tritonclient's thread tells it while the start waits for a slot
        return session

    world = started(server, [], save_every=1, session_factory=session_in_line, on_place=places.append)
    world.step(Controls(keys="a"), end=True)  # saves: its outcome is heard too
    while world.next_block(5) is not None:
        pass
    assert places == [Place(1, 0.5)]
