"""A serving group of N local processes over gloo, without tritonserver: each process is one `GroupMember`, and
requests reach a member as named arrays, as Triton hands them to the adapter (parse, admission, the group
loop, the streams: everything but Triton's own machinery). For tests and benchmarks.

    with LocalGroup(engine_settings, ServingSettings(), ranks=2) as group:
        blocks = group.stream(request, rank=1)  # a whole trajectory, owned by rank 1
        session = group.steered(first_request)  # a steered session: session.step(controls) -> its block

It is in the launch room, not the serving room: it does the launcher's job without tritonserver (starts a group's
members as processes with the group's secret, and stops them), no serving module uses it, and its users stand where
a launcher does. The members are the serving room's `GroupMember`s, as under Triton; in their processes it adds only
a responder into a queue, where the adapter has Triton's.
"""
from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import multiprocessing as mp
import os
import queue
import secrets
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..api.codec import (SnapshotNotice, controls_arrays, controls_parameters, request_arrays, request_parameters,
                         resume_parameters)
from ..api.contract import KEY_HEADER, PARAM_PAUSE, PARAM_RETURN_USED, SEQUENCE_END, SEQUENCE_START
from ..api.errors import InputError
from ..api.request import Controls, ResumeRequest, SessionRequest
from ..api.refusal import Refusal
from ..engine.blocks import BlockOutput
from ..engine.settings import EngineSettings
from ..parallel.local import process_context
from ..parallel.ports import free_port
from ..parallel.secret import SECRET_VARIABLE
from ..serving.books import BooksAddress
from ..serving.settings import ServingSettings

DEFAULT_TIMEOUT_S = 120.0


class LocalStreamError(RuntimeError):
    """A request ended with an error response; the message is the server's sentence."""


@dataclass(frozen=True)
class LocalBlock:
    """One block's response, as a client would read it."""

    block_index: int
    num_blocks: int
    latents: np.ndarray  # float32 [z, block_frames, h, w]
    frames: np.ndarray  # uint8 [n, H, W, 3]
    held: bool
    camera: np.ndarray | None  # the poses the block ran on
    prompt: str  # the prompt in force
    final: bool
    recached: bool = False  # its cached history was recomputed under its prompt first


@dataclass(frozen=True)
class LocalPlace:
    """A waiting session's place in the queue (0: it has its slot), a response without a block."""

    position: int
    wait_s: float


# -- in each member's process ------------------------------------------------------------------------------

class _QueueResponder:
    """A request's reply channel into the parent's queue (what TritonResponder is under tritonserver)."""

    def __init__(self, call: int, outbox: mp.Queue) -> None:
        self.call, self.outbox = call, outbox
        self.closed = self.cancelled = False
        self._lock = threading.Lock()

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        block = LocalBlock(output.block_index, output.num_blocks, output.latents[0].numpy(), frames, output.held,
                           output.camera, output.prompt, final, output.recached)
        self._send("block", block, final)

    def send_error(self, refusal: Refusal) -> None:
        self._send("error", refusal.message, True)

    def send_place(self, position: int, wait_s: float) -> None:
        self._send("place", LocalPlace(position, wait_s), False)

    def send_notice(self, notice: SnapshotNotice) -> None:
        self._send("notice", notice, False)

    def send_saves(self, listing: str) -> None:
        self._send("saves", json.loads(listing), True)

    def finish(self) -> None:
        self._send("finish", None, True)

    def is_cancelled(self) -> bool:
        return self.closed or self.cancelled

    def _send(self, kind: str, payload: Any, final: bool) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = final
            self.outbox.put((kind, self.call, payload))


def _member_main(rank: int, ranks: int, engine_settings: EngineSettings, serving: ServingSettings, secret: str,
                 setup: str | None, keys: str | None, books: BooksAddress | None, inbox: mp.Queue,
                 outbox: mp.Queue) -> None:
    from ..serving.bootstrap import GroupMember, Hooks, Location
    from ..serving.keys import Gate, KeyRing

    os.environ[SECRET_VARIABLE] = secret
    gate = Gate(None if keys is None else KeyRing.parse(keys))  # the adapter's door, on the keys of `keys`
    try:
        if setup:
            _resolve(setup)(rank)
        member = GroupMember(engine_settings, serving, Location(rank, ranks, "cpu", ranks),
                             Hooks(on_failure=lambda exc: outbox.put(("failed", rank, repr(exc)))), books=books)
    except BaseException:
        outbox.put(("crashed", rank, traceback.format_exc()))
        return
    outbox.put(("ready", rank, None))
    responders: dict[int, _QueueResponder] = {}
    while True:
        message = inbox.get()
        kind = message[0]
        if kind == "request":
            _, call, arrays, parameters, key, flags = message
            responders[call] = _QueueResponder(call, outbox)
            who, parameters = gate.admit(parameters)
            if isinstance(who, Refusal):
                member.refuse(responders[call], who)
            else:
                member.handle(arrays.get, parameters, key, flags, lambda parsed, r=responders[call]: r, who)
        elif kind == "cancel":
            if (responder := responders.get(message[1])) is not None:
                responder.cancelled = True
        elif kind == "call":
            outbox.put(("called", rank, _resolve(message[1])(member)))
        elif kind == "stop":
            member.stop()
            outbox.put(("stopped", rank, None))
            return
        responders = {c: r for c, r in responders.items() if not r.closed}


def _resolve(name: str) -> Callable:
    """'package.module:function' (importable by a spawned process)."""
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


# -- in the caller's process -------------------------------------------------------------------------------

class LocalCall:
    """One request's responses, in order."""

    def __init__(self, group: LocalGroup, rank: int, call: int) -> None:
        self.group, self.rank, self.call = group, rank, call
        self.responses: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.places: list[LocalPlace] = []  # the places in the queue it was told, in order
        self.notices: list[SnapshotNotice] = []  # the saves' outcomes it was told, in order
        self.done = False

    def next(self, timeout_s: float = DEFAULT_TIMEOUT_S, places: bool = False,
             notices: bool = False) -> LocalBlock | LocalPlace | SnapshotNotice | dict | None:
        """The next block (or, with `places` or `notices`, the next place in the queue or save's outcome too); None when
        the request ended without one. Raises LocalStreamError on an error."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.done:
                raise LocalStreamError("the request has ended")
            try:
                kind, payload = self.responses.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no response within {timeout_s} s") from None
            if kind == "error":
                self.done = True
                raise LocalStreamError(payload)
            if kind == "place":
                self.places.append(payload)
                if places:
                    return payload
                continue
            if kind == "notice":
                self.notices.append(payload)
                if notices:
                    return payload
                continue
            if kind == "saves":  # the key's snapshots (request parameter saves): the request's one answer
                self.done = True
                return payload
            self.done = kind == "finish" or payload.final
            return payload if kind == "block" else None

    def blocks(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[LocalBlock]:
        """Every block until the final response."""
        blocks = []
        while not self.done:
            if (block := self.next(timeout_s)) is not None:
                blocks.append(block)
        return blocks

    def cancel(self) -> None:
        """The client goes away (what Triton's cancellation flag says)."""
        self.group._send(self.rank, ("cancel", self.call))


class LocalSteered:
    """A steered session on one member, one request per block, as a Triton sequence."""

    def __init__(self, group: LocalGroup, rank: int, key: str, arrays: dict[str, np.ndarray], parameters: dict,
                 return_used: bool, user_key: str | None = None) -> None:
        """Its first request: a new world's (request_arrays) or a snapshot's (resume_parameters); user_key: the key
        every request of it carries (a group with keys)."""
        self.group, self.rank, self.key = group, rank, key
        self.return_used = return_used
        self.user = {} if user_key is None else {KEY_HEADER: user_key}
        self.call = group.request(rank, arrays, parameters | self.user, key, SEQUENCE_START)

    def next_block(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> LocalBlock | None:
        return self.call.next(timeout_s)

    def step(self, controls: Controls | None, end: bool = False, **parameters: Any) -> LocalCall:
        """Send the next block's camera (None with end: end without another block); `next_block` reads it."""
        arrays, extra = ({}, {}) if controls is None else (controls_arrays(controls), controls_parameters(controls))
        self.call = self.group.request(self.rank, arrays, {PARAM_RETURN_USED: self.return_used, **extra, **parameters,
                                                           **self.user}, self.key, SEQUENCE_END if end else 0)
        return self.call

    def pause(self) -> LocalCall:
        return self.group.request(self.rank, {}, {PARAM_PAUSE: True, **self.user}, self.key, 0)


class LocalGroup:
    """`ranks` members as local processes forming one serving group (gloo), started and loaded on entry."""

    def __init__(self, engine_settings: EngineSettings, serving: ServingSettings, ranks: int = 1,
                 setup: str | None = None, start_timeout_s: float = 300.0, keys: str | None = None,
                 books: BooksAddress | None = None) -> None:
        """setup: 'module:function', called with the rank in each member's process before it starts; keys: a keys
        file's text, whose keys alone open the door (a request carries its key as the parameter `lingbot-key`, as
        Triton forwards the header); books: the fleet's shared books."""
        self.ranks = ranks
        ctx = process_context()
        serving = dataclasses.replace(serving, rendezvous_port=free_port())
        secret = secrets.token_hex(16)
        # One outbox per member: a member stopped or killed while it holds its queue's write lock (a block half
        # written) must not silence the others, as one shared queue's lock would.
        self._outboxes: list[mp.Queue] = [ctx.Queue() for _ in range(ranks)]
        self._inboxes = [ctx.Queue() for _ in range(ranks)]
        self._procs = [ctx.Process(target=_member_main, daemon=True,
                                   args=(r, ranks, engine_settings, serving, secret, setup, keys, books,
                                         self._inboxes[r], self._outboxes[r])) for r in range(ranks)]
        self._calls: dict[int, LocalCall] = {}
        self._control: queue.Queue[tuple[str, int, Any]] = queue.Queue()
        self._ids = itertools.count()
        self._keys = itertools.count(1)
        self.start_timeout_s = start_timeout_s

    def __enter__(self) -> LocalGroup:
        for p in self._procs:
            p.start()
        for rank, outbox in enumerate(self._outboxes):
            threading.Thread(target=self._demux, args=(outbox,), name=f"local-group-demux-{rank}", daemon=True).start()
        try:
            self._await_all("ready", self.start_timeout_s)
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests ------------------------------------------------------------------------------------------

    def request(self, rank: int, arrays: dict[str, np.ndarray], parameters: dict, key: str = "",
                flags: int = 0) -> LocalCall:
        """One raw request to member `rank`: named input arrays, request parameters, sequence id and flags."""
        call = LocalCall(self, rank, next(self._ids))
        self._calls[call.call] = call
        self._send(rank, ("request", call.call, arrays, json.dumps(parameters), key, flags))
        return call

    def stream(self, request: SessionRequest, rank: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[LocalBlock]:
        """A whole trajectory's blocks (one sequence of one request, as the client sends it)."""
        call = self.request(rank, request_arrays(request), request_parameters(request), self.new_sequence(),
                            SEQUENCE_START | SEQUENCE_END)
        return call.blocks(timeout_s)

    def steered(self, request: SessionRequest, rank: int = 0, user_key: str | None = None) -> LocalSteered:
        """user_key: the key its requests carry (a group with keys)."""
        if not request.steered:
            raise InputError("a steered session's first request has no num_frames")
        return LocalSteered(self, rank, self.new_sequence(), request_arrays(request), request_parameters(request),
                            request.return_used, user_key)

    def resumed(self, resume: ResumeRequest, rank: int = 0, user_key: str | None = None) -> LocalSteered:
        """A steered session that opens the world of a snapshot (`resume.sequence_id` is this group's own)."""
        return LocalSteered(self, rank, self.new_sequence(), controls_arrays(resume.controls), resume_parameters(resume),
                            resume.return_used, user_key)

    def new_sequence(self) -> str:
        return str(next(self._keys))

    def call(self, rank: int, function: str, timeout_s: float = 60.0) -> Any:
        """`function(member)` ('module:function') run in member `rank`'s process, between requests."""
        self._send(rank, ("call", function))
        return self._await("called", rank, timeout_s)

    # -- the processes -------------------------------------------------------------------------------------

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop every live member (they unload together, as a group does), then end the processes."""
        live = [r for r, p in enumerate(self._procs) if p.is_alive()]
        for r in live:
            self._send(r, ("stop",))
        try:
            for r in live:
                self._await("stopped", r, timeout_s)
        finally:
            self.kill()

    def kill(self, rank: int | None = None) -> None:
        """SIGKILL one member (a dead rank), or every one."""
        for r, p in enumerate(self._procs):
            if rank is None or r == rank:
                if p.is_alive():
                    p.kill()
                p.join(10)

    @property
    def pids(self) -> list[int]:
        """The members' process ids, by rank."""
        return [p.pid for p in self._procs]

    def events(self, kind: str, timeout_s: float) -> tuple[int, Any]:
        """The next (rank, payload) of a member event of this kind ('failed': a member's group failed)."""
        return self._await(kind, None, timeout_s)

    def _send(self, rank: int, message: tuple) -> None:
        self._inboxes[rank].put(message)

    def _demux(self, outbox: mp.Queue) -> None:
        while True:
            try:
                kind, tag, payload = outbox.get()
            except (EOFError, OSError):
                return
            if kind in ("block", "place", "notice", "saves", "error", "finish"):
                self._calls[tag].responses.put((kind, payload))
            else:
                self._control.put((kind, tag, payload))

    def _await_all(self, kind: str, timeout_s: float) -> None:
        for _ in range(self.ranks):
            self._await(kind, None, timeout_s)

    def _await(self, kind: str, rank: int | None, timeout_s: float) -> Any:
        """The payload of the next control message `kind` (from `rank`, or any); a crash raises."""
        deferred = []
        try:
            while True:
                try:
                    got, tag, payload = self._control.get(timeout=timeout_s)
                except queue.Empty:
                    raise TimeoutError(f"no {kind!r} from member {rank if rank is not None else 'any'} within "
                                       f"{timeout_s} s") from None
                if got == "crashed":
                    raise RuntimeError(f"member {tag} failed:\n{payload}")
                if got == kind and (rank is None or tag == rank):
                    return payload if rank is not None else (tag, payload)
                deferred.append((got, tag, payload))
        finally:
            for item in deferred:
                self._control.put(item)
