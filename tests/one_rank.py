"""One rank's intake and group loop, wired as serving/bootstrap's GroupMember wires them, without a process group
or Triton: what the one-rank tests drive."""
from __future__ import annotations

import queue
from collections.abc import Callable

from backend.api.request import ResumeRequest, SessionRequest, StepRequest
from backend.engine.rollout import WorldModelEngine
from backend.serving.bootstrap import Hooks, owner_side
from backend.serving.books import BooksAddress
from backend.serving.keys import ANONYMOUS, Principal
from backend.serving.settings import ServingSettings
from backend.serving.waits import QueueCounts
from backend.serving.loop import GroupLoop, LoopHooks
from backend.serving.loop_cpu import LoopCpu
from backend.serving.streams import Responder
from backend.serving.threads import CoreSplit


class OneRank:
    def __init__(self, engine: WorldModelEngine, settings: ServingSettings,
                 on_failure: Callable[[BaseException], None] = lambda exc: None,
                 on_ended: Callable[[str], None] | None = None, on_queue: Callable[[QueueCounts], None] | None = None,
                 threads: CoreSplit | None = None, cpu: LoopCpu | None = None, books: BooksAddress | None = None,
                 hooks: Hooks | None = None) -> None:
        """hooks: the parks' and unparks' (the others are the arguments')."""
        self.engine, self.settings = engine, settings
        hooks = hooks or Hooks()
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.loop = GroupLoop(engine, settings, None, inbox.put,
                              LoopHooks(on_failure=on_failure, on_ended=on_ended, on_queue=on_queue,
                                        on_unpark=hooks.on_unpark), threads=threads, cpu=cpu)
        self.intake = owner_side(0, 1, settings, engine, self.loop.post, inbox, hooks, books)

    def submit(self, request: SessionRequest | ResumeRequest | StepRequest, responder: Responder,
               principal: Principal = ANONYMOUS) -> None:
        """A request as the member hands it over (its sequence's open pause is answered first), from `principal`'s
        key."""
        self.intake.arrive(getattr(request, "sequence_id", "") or "", request, responder, principal=principal)

    @property
    def sessions(self) -> dict:
        """The engine sessions this rank holds (read from the test's thread: a snapshot, for polling)."""
        return {sid: here.engine for sid, here in dict(self.loop.here).items() if here.engine is not None}

    def parked(self) -> set[str]:
        """The sessions parked off their slot (read from the test's thread: a snapshot, for polling)."""
        return {sid for sid, s in dict(self.loop.scheduler.table).items() if s.in_park}

    @property
    def scheduler(self):
        return self.loop.scheduler

    @property
    def control(self):
        return self.loop.control

    def stop(self) -> None:
        self.loop.stop()
        self.intake.close()
