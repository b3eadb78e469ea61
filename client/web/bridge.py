"""One page session's world: a steered session on Triton, stepped with the page's held keys, its blocks relayed
to the world's video (client/web/broadcast: the page's WebRTC and its watchers) and, while the page has no WebRTC,
as JPEG on its websocket.

Lookahead like `python -m client play` (`--lookahead`, 1 by default): the start is followed by `lookahead` steps,
and when a block arrives the next step is sent at once with the keys held at that moment, so at lookahead 1 the
server always has the camera of the block after the one it is computing. A world
event (the page's new prompt) rides on the next step sent; each block's header names the prompt in force. The
session is recorded as it plays (what the server ran, see client/recording.py), beside its MP4, with its snapshots.

The world survives its server (client/world.py): it is saved every `save_every` blocks and when the page asks
("Save world": the next step carries the save; its id comes back once durable), and when the stream fails the bridge
resumes it from the last snapshot and makes the blocks since again, telling the page ("failover" messages). A page
opened with `?resume=ID` starts from that snapshot (unrecorded: a recording starts at a world's first block).
"""
from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from backend.api.contract import SNAPSHOT_ID_PATTERN
from backend.api.controls import parse_keys
from backend.api.request import Controls, SessionRequest, check_prompt
from client.connection import Connection
from client.images import synthetic_image
from client.pace import DeliveryRate
from client.recording import Recorder
from client.steer import SteeredSession
from client.stream import StreamError, show_place
from client.used_steps import UsedSteps
from client.video import DEFAULT_FPS, Mp4Writer
from client.web.broadcast import Broadcast
from client.web.codes import INVALID_MESSAGE
from client.web.frames import encode_jpeg, open_upload, rgb
from client.world import DEFAULT_SAVE_EVERY, Failover, PlayedWorld, Saved

Send = Callable[[dict[str, Any] | bytes], Awaitable[None]]
MAX_SIDE = 2048  # the page's size fields; the server applies its own max_pixels
STARTING = "the server opens the session and computes its first block"
STARTING_RESUME = "the server opens the saved world and computes its next block"


@dataclass(frozen=True)
class ResumeStart:
    """A page's start from a saved world: its snapshot, and the keys of its next block."""

    snapshot_id: str
    keys: str


@dataclass(frozen=True)
class WorldStart:
    """A page's start of a new world, checked: `request` makes its first frame (the page's picture decoded, or the
    test scene drawn), which takes a while for a large one: the page's own thread's work, not the event loop's."""

    prompt: str
    height: int
    width: int
    seed: int
    keys: str
    picture: Image.Image | None  # the page's first frame, opened and its size checked (None: the test scene)

    def request(self) -> SessionRequest:
        image = rgb(self.picture) if self.picture is not None else synthetic_image(self.height, self.width)
        return SessionRequest(image=image, prompt=self.prompt, poses=None, num_frames=None, seed=self.seed,
                              height=self.height, width=self.width, keys=self.keys, return_latents=False,
                              return_used=True)


def start_request(message: dict[str, Any]) -> WorldStart | ResumeStart:
    """The start a page's start message asks for; ValueError names what is wrong in plain words."""
    if (resume := message.get("resume")) is not None:
        if extra := sorted(k for k in ("prompt", "image", "height", "width", "seed") if message.get(k) is not None):
            raise ValueError(f"a saved world's prompt, first frame, size and seed are its own: drop {extra}")
        if not re.fullmatch(SNAPSHOT_ID_PATTERN, resume):
            raise ValueError("a saved world's id is 32 lowercase hex digits (the page's ?resume=ID)")
        return ResumeStart(resume, parse_keys(str(message.get("keys") or "-")))
    prompt = str(message.get("prompt") or "").strip()
    if not prompt:
        raise ValueError("type a prompt before starting")
    try:
        height, width, seed = (int(message.get(k, d)) for k, d in (("height", 480), ("width", 832), ("seed", 42)))
    except (TypeError, ValueError):
        raise ValueError("height, width and seed must be whole numbers") from None
    if not (0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE):
        raise ValueError(f"height and width must be between 1 and {MAX_SIDE}, got {height}x{width}")
    picture = open_upload(message["image"]) if message.get("image") else None
    return WorldStart(prompt, height, width, seed, parse_keys(str(message.get("keys") or "-")), picture)


def recording_path(video_path: Path) -> Path:
    """Where a page session's recording goes, beside its MP4."""
    return video_path.with_suffix(".npz")


def plain(exc: Exception) -> str:
    """An error as the page shows it: the server's own sentence when it sent one."""
    return exc.sentence if isinstance(exc, StreamError) else str(exc)


class Player:
    """Plays one steered session for one page: `hold` keys, `stop`, and `close` when the page goes.

    Its blocking calls (the wait for a block, the MP4 and JPEG encodes) run on its own thread, not asyncio's
    shared pool: pages waiting for blocks would otherwise take every worker of that pool, which the web server
    uses too (serving files), and stall each other and the page itself.
    """

    def __init__(self, url: str, model: str, video_path: Path, send: Send, timeout: float, lookahead: int = 1,
                 connection: Connection = Connection(), save_every: int = DEFAULT_SAVE_EVERY,
                 broadcast: Broadcast | None = None, jpeg: Callable[[], bool] = lambda: True) -> None:
        """lookahead: steps sent ahead of the block on screen (0: each step waits for the block before it);
        connection: TLS and the key the page's sessions run on (its user's, from its sign-in); save_every: a
        snapshot every this many blocks, to fail over from (0: only those the page asks for); broadcast: the
        world's video over WebRTC, which takes every block's frames; jpeg: whether a block's frames also go to
        the page as JPEG messages now (its WebRTC is not up)."""
        self.url, self.model, self.video_path, self.send, self.timeout = url, model, video_path, send, timeout
        self.broadcast, self.jpeg = broadcast, jpeg
        self.connection = connection
        self.lookahead, self.save_every = lookahead, save_every
        self.recording_path = recording_path(video_path)
        self.keys = ""
        self.pending: Controls | None = None  # a prompt event not sent yet (its prompt, its recache)
        self.save_asked = False  # the page asked for a save: the next step carries it
        self.stopping = False  # the page asked for the end: sent after the next block (the world's thread is busy)
        self.last_save: str | None = None  # the id of the world's last durable save
        self.over = False  # the world's last word ("ended", "error") is told or on its way: no page waits for it
        self._world: PlayedWorld | None = None
        self._used: UsedSteps | None = None
        self._here = asyncio.Event()  # the page is there: blocks go on; away, no step is sent
        self._here.set()
        self._asked = 0  # the start's and steps' blocks not come yet
        self._owed = 0  # steps not sent while the page was away (one for each block that came meanwhile)

    def hold(self, keys: str) -> None:
        self.keys = parse_keys(keys or "-")

    def event(self, prompt: str, recache: bool = False) -> None:
        """A prompt event: `prompt` rides on the next step (a newer one before it is sent replaces it); with
        `recache`, the cached frames are recomputed under it first."""
        prompt = prompt.strip()
        check_prompt(prompt)  # InputError (a ValueError) names what is wrong
        self.pending = Controls(prompt=prompt, recache=recache)

    def _next_step(self) -> Controls:
        event, self.pending = self.pending, None
        return Controls(keys=self.keys) if event is None else \
            Controls(keys=self.keys, prompt=event.prompt, recache=event.recache)

    def save(self) -> None:
        """Save the world after the block of the next step sent."""
        self.save_asked = True

    def stop(self) -> None:
        """End the session after the blocks already asked for."""
        self.stopping = True

    def away(self) -> None:
        """The page went: no step is sent until it is back (the world makes the blocks asked for, then waits), and
        it holds no keys."""
        self._here.clear()
        self.keys = ""

    def back(self, keys: str) -> None:
        """The page is back, holding `keys`: the steps owed go out now, and the world goes on."""
        self.keys = keys
        self._here.set()
        while self._owed and self._world is not None and self._used is not None and not self.stopping:
            self._owed -= 1
            self._send_step(self._world, self._used)
            self._asked += 1

    def close(self) -> None:
        """Cancel the Triton stream: the server frees the session's caches. Safe to call twice."""
        world, self._world = self._world, None
        if world is not None:
            world.close()

    async def play(self, start: WorldStart | ResumeStart) -> None:
        """Run the session to its end, relaying every block, its place in the queue while it waits, its saves and its
        failovers; errors go to the page with their code. The page's first word comes before anything is done:
        {"type": "starting", "text"} (a page seated at once hears nothing more until its first block)."""
        await self.send({"type": "starting", "text": STARTING_RESUME if isinstance(start, ResumeStart) else STARTING})
        loop = asyncio.get_running_loop()
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="page")
        recorder: Recorder | None = None

        def tell(message: dict[str, Any]) -> None:  # from the world's threads
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.send(message)))

        async def save() -> bool:  # what was played, also before a failure (a bug report's evidence)
            if recorder is None:
                return False
            saved = await loop.run_in_executor(thread, recorder.save, self.recording_path)
            return saved is not None

        try:
            try:
                request = start if isinstance(start, ResumeStart) else await loop.run_in_executor(thread, start.request)
            except ValueError as exc:  # a first frame whose header read well but whose pixels do not decode
                self.over = True
                await self.send({"type": "error", "message": str(exc), "recorded": False, "code": INVALID_MESSAGE,
                                 "retry_after_s": None})
                return
            recorder = Recorder(request) if isinstance(request, SessionRequest) else None
            self._world = PlayedWorld(
                self.url, model_name=self.model, connection=self.connection, save_every=self.save_every,
                on_place=lambda place: tell({"type": "place", "position": place.position, "wait_s": place.wait_s,
                                             "text": show_place(place)}),
                on_snapshot=lambda saved: tell(self._saved(saved, recorder)),
                on_failover=lambda failover: tell(failover_message(failover)), session_factory=SteeredSession)
            with Mp4Writer(self.video_path, DEFAULT_FPS) as mp4:
                await self._relay(self._world, request, mp4, recorder, thread)
            self.over = True
            await self.send({"type": "ended", "frames": mp4.frames_written, "recorded": await save()})
        except (StreamError, ValueError) as exc:
            refusal = exc.refusal if isinstance(exc, StreamError) else None
            self.over = True
            await self.send({"type": "error", "message": plain(exc), "recorded": await save(),
                             "code": refusal and refusal.code, "retry_after_s": refusal and refusal.retry_after_s})
        finally:  # the page's handler cancels this task when the page goes: the close and shutdown run all the same
            try:
                await asyncio.shield(asyncio.to_thread(self.close))  # cancels the stream: a wait on the thread ends
            finally:
                thread.shutdown(wait=False)

    async def _relay(self, world: PlayedWorld, request: SessionRequest | ResumeStart, mp4: Mp4Writer,
                     recorder: Recorder | None, thread: ThreadPoolExecutor) -> None:
        def on_thread(call: Callable[..., Any], *args: Any) -> Awaitable[Any]:
            return asyncio.get_running_loop().run_in_executor(thread, call, *args)

        if isinstance(request, ResumeStart):
            await on_thread(world.resume, request.snapshot_id, Controls(keys=request.keys), None, False)
            used = UsedSteps(Controls(keys=request.keys), None)
        else:
            await on_thread(world.start, request)
            used = UsedSteps(Controls(keys=request.keys or ""), request.prompt)
        self._used, self._asked = used, 1
        for _ in range(self.lookahead):
            self._send_step(world, used)
            self._asked += 1
        received, rate, ending = 0, DeliveryRate(), False
        while True:
            if not self._asked and not ending:  # the page is away and every block asked for came: the world waits
                await self._here.wait()
            if (block := await on_thread(world.next_block, self.timeout)) is None:
                break
            latency = world.step_latency_s
            self._asked -= 0 if block.held else 1  # a held block answers no step
            if self.stopping and not ending:
                ending = True
                world.end()
            elif not ending and self._here.is_set():
                self._send_step(world, used)
                self._asked += 1
            elif not ending:
                self._owed += 1
            label = used.label(block)  # what the server ran it on (its held flag, its prompt_used)
            if recorder is not None:
                recorder.add(block)
            await on_thread(mp4.append, block.frames)
            if self.broadcast is not None:
                self.broadcast.push(block.block_index, block.frames)
            jpegs = await on_thread(lambda: [encode_jpeg(frame) for frame in block.frames]) if self.jpeg() else []
            await self.send({
                "type": "block", "index": block.block_index, "held": block.held, "frames": len(block.frames),
                "keys": label.keys, "prompt": label.prompt, "event": label.event,
                "step_latency_s": latency,
                "first_block_s": latency if received == 0 else None,
                "realtime_factor": rate.add(len(block.frames), block.arrival_s),
            })
            for jpeg in jpegs:
                await self.send(jpeg)
            received += 1

    def _saved(self, saved: Saved, recorder: Recorder | None) -> dict[str, Any]:
        if saved.error is None:
            self.last_save = saved.snapshot_id
        return saved_message(saved, recorder)

    def _send_step(self, world: PlayedWorld, used: UsedSteps) -> None:
        if self.save_asked:
            self.save_asked = False
            world.save()
        step = self._next_step()
        world.step(step)
        used.sent(step)


def saved_message(saved: Saved, recorder: Recorder | None) -> dict[str, Any]:
    """A save's outcome as the page reads it (a durable one noted in the recording)."""
    if recorder is not None and saved.error is None:
        recorder.note_snapshot(saved.snapshot_id, saved.block_index, saved.released)
    return {"type": "snapshot", "id": saved.snapshot_id, "block": saved.block_index, "asked": saved.asked,
            "error": saved.error, "released": saved.released}


def failover_message(failover: Failover) -> dict[str, Any]:
    """A failover as the page reads it: lost (took_s null), then resumed."""
    return {"type": "failover", "block": failover.resume_block, "replayed": failover.replayed,
            "resent": failover.resent, "reason": failover.reason, "took_s": failover.took_s,
            "attempts": failover.attempts, "differed": failover.differed}
