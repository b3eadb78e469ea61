"""One rank of a serving group, started: it joins the group, loads its part of the model, runs the group loop,
and takes requests as named arrays. The Triton adapter starts one per model instance; tests and benchmarks
start N of them as local processes (launch/local_group) without tritonserver."""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass

import numpy as np
import torch

from ..api.codec import parse_request
from ..api.description import ServerDescription
from ..api.errors import ConfigError, InputError
from ..api.refusal import Refusal
from ..api.request import SessionRequest, StepRequest
from ..engine.settings import EngineSettings
from ..engine.rollout import WorldModelEngine
from ..engine.snapshot.store import SnapshotStore
from ..engine.validation import GLOBAL_WINDOW, checked_spec, describe_settings
from ..parallel.doorbell import StoreDoorbell
from ..parallel.group import join_group, leave_group
from ..parallel.host_claim import claim_for_this_host, member_claim
from ..parallel.grid import RankGrid
from ..parallel.mesh import Mesh
from ..parallel.secret import group_secret
from ..parallel.sequence import SequenceParallel
from . import messages
from .settings import ServingSettings
from . import mail
from .admission import Admission
from .books import BooksAddress
from .intake import Intake
from .keys import ANONYMOUS, Principal
from .loop import GroupLoop, LoopHooks
from .description import check_description
from .waits import QueueCounts
from .loop_cpu import LoopCpu, Report
from .parks import Parks
from .stores import clear_park_tier, park_root
from .saves import Saves
from .streams import Responder
from .threads import CoreSplit, instance_cores

log = logging.getLogger("backend")


@dataclass(frozen=True)
class Location:
    """Where a member runs: its global rank among `ranks`, its device, and how many members share its host."""

    rank: int
    ranks: int
    device: str = "cpu"  # "cpu" or "cuda:N"
    host_members: int = 1  # members on this host (a CPU member takes its share of the host's cores)


@dataclass
class Hooks:
    """What the host of a member (the Triton adapter, a test) learns from it; every hook is optional."""

    on_failure: Callable[[BaseException], None] = lambda exc: None  # the group failed; the model is freed
    on_settings: Callable[[dict], None] = lambda sources: None  # the resolved settings and where each came from
    # (EngineSpec.sources), before loading
    on_prompts: Callable[[int, int], None] | None = None  # see LoopHooks
    on_ended: Callable[[str], None] | None = None  # see LoopHooks
    on_queue: Callable[[QueueCounts], None] | None = None  # see LoopHooks
    on_snapshot: Callable[[str], None] | None = None  # see LoopHooks; also the saves' outcomes, on the intake's thread
    on_request: Callable[[str], None] = lambda name: None  # a request a key opened the door for (its name), on the
    # intake's thread
    on_park: Callable[[str, str, float], None] | None = None  # see serving/parks.Parks (on the intake's thread)
    on_parked_bytes: Callable[[int, int], None] | None = None  # see serving/parks.Parks (on the intake's thread)
    on_unpark: Callable[[str, float, float], None] | None = None  # see LoopHooks
    on_loop_block: Report | None = None  # LoopCpu's report


class GroupMember:
    """One rank, joined and loaded, its group loop running."""

    def __init__(self, engine_settings: EngineSettings, serving: ServingSettings, location: Location, hooks: Hooks,
                 description: ServerDescription | None = None, books: BooksAddress | None = None) -> None:
        """Validate alone (before waiting for peers or reading weights), join the group, load, start the loop.
        description: what the model config says of this server (api/description), checked against it; books: the
        fleet's shared books (None: this group keeps its books in process)."""
        rank, ranks = location.rank, location.ranks
        grid = RankGrid(engine_settings.tp_degree, engine_settings.sp_degree)
        if grid.ranks != ranks:
            raise ConfigError(
                f"tp_degree x sp_degree = {engine_settings.tp_degree} x {engine_settings.sp_degree} must equal the number "
                f"of model instances of all servers ({ranks} = host_count={serving.host_count} x "
                f"{ranks // serving.host_count})"
            )
        grid.check_hosts(serving.host_count)
        engine_settings = dataclasses.replace(engine_settings, device=location.device)
        spec = checked_spec(engine_settings, ranks)
        check_description(description, spec, serving)
        on_gpu = location.device.startswith("cuda")
        threads = None
        if on_gpu:
            torch.cuda.set_device(location.device)
            # On an NCCL timeout abort the communicators but keep the process, so the loop's next
            # collective raises and the failure path answers the streams (PyTorch's default, 3, kills it).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        else:
            cores = instance_cores(location.host_members)  # this host's cores shared among its own members
            torch.set_num_threads(cores)  # this thread's (loading); the loop and the decode sender set their own
            threads = CoreSplit.of(cores)
        self.rank, self.hooks = rank, hooks
        self._unloading = threading.Event()  # set by Triton's finalize thread, read by the loop's failure path
        hooks.on_settings(spec.sources)
        if rank == 0:
            log.info("checkpoint %s: %s layout", engine_settings.checkpoint, spec.checkpoint.layout.kind.name)
            for line in describe_settings(spec):
                log.info("setting %s", line)
        # One member per rank of this group on this host: a load while this group serves (the operator's reload)
        # is refused at once by every new instance alike, so none waits for a peer that cannot start.
        self._claim = claim_for_this_host(member_claim(serving.rendezvous_port, rank))
        if self._claim is None:
            raise RuntimeError(messages.RELOAD_REFUSED.message)
        groups = None
        try:
            secret = group_secret() if ranks > 1 else ""
            groups = join_group(rank, ranks, serving.rendezvous_host, serving.rendezvous_port,
                                "nccl" if on_gpu else "gloo", serving.init_timeout_s, serving.collective_timeout_s,
                                secret, engine_settings.split_decode)
            self.load_id = groups.load_id
            log.info("rank %d/%d on %s: loading %s (RSS before: %s)", rank, ranks, location.device,
                     engine_settings.checkpoint, rss())
            group = SequenceParallel(groups.data)
            mesh = Mesh.build(group, engine_settings.tp_degree, serving.collective_timeout_s)
            # The loop and its decode thread hold the engine from here on (the loop lets it go when it ends).
            engine = WorldModelEngine(spec, group, mesh=mesh, decode_group=groups.decode)
            self.settings_used = engine.settings_used  # sent with a session's first block on return_used
            if rank == 0:  # what a killed load left in the park tier, before any rank parks a world
                clear_park_tier(serving)
            groups.all_arrived("loaded")  # every rank has loaded before the loop starts
            doorbell = StoreDoorbell(serving.rendezvous_host, serving.rendezvous_port, secret,
                                     serving.collective_timeout_s) if ranks > 1 else None
            intake_inbox: queue.SimpleQueue = queue.SimpleQueue()
            self.loop = GroupLoop(
                engine, serving, groups.control, intake_inbox.put, LoopHooks(
                    on_failure=self._on_group_failure, on_prompts=hooks.on_prompts, on_ended=hooks.on_ended,
                    on_queue=hooks.on_queue, on_snapshot=hooks.on_snapshot, on_unpark=hooks.on_unpark),
                doorbell=doorbell, threads=threads,
                cpu=LoopCpu(hooks.on_loop_block))
            self.intake = owner_side(rank, ranks, serving, engine, self.loop.post, intake_inbox, hooks, books)
        except BaseException as exc:
            if groups is not None:
                with contextlib.suppress(Exception):  # the store may be gone with rank 0
                    groups.fail_start(rank, exc)
            self._claim.close()
            raise
        log.info("rank %d/%d ready (attention: %s; torch threads: %s)", rank, ranks, engine.attention_name,
                 f"DiT {threads.dit}, decode {threads.decode}" if threads else "as they are")

    def handle(self, get_input: Callable[[str], np.ndarray | None], parameters_json: str, key: str, flags: int,
               responder_for: Callable[[SessionRequest | StepRequest | None], Responder],
               principal: Principal = ANONYMOUS) -> None:
        """One request as it arrives (named input arrays, its parameters without a key, its Triton sequence id and
        flags), from `principal` (whose key the door let in); `responder_for(parsed)` makes its reply channel
        (parsed None: the request could not be parsed)."""
        try:
            parsed = parse_request(get_input, parameters_json, key, flags)
        except InputError as exc:
            self.intake.arrive(key, None, responder_for(None), exc.refusal, principal)
            return
        self.intake.arrive(key, parsed, responder_for(parsed), principal=principal)

    def refuse(self, responder: Responder, refusal: Refusal) -> None:
        """A request its door refused (no key, a wrong one): answered by the intake, touching no session."""
        self.intake.arrive("", None, responder, refusal)

    def drain(self) -> None:
        """The server drains (its launcher's signal): no new session is taken; every steered session is saved
        where it stands and ends MOVED with its snapshot's id, for its client to resume elsewhere."""
        self.intake.post(mail.Drain())

    def revoke(self, tags: set[str]) -> None:
        """The operator's reload of the keys dropped these keys: their sessions end at the next boundary."""
        self.loop.post(mail.Revoked(frozenset(tags)))

    def end_sessions(self) -> None:
        """The server is stopping: every session ends now (SERVER_STOPPING); this rank's stop travels with its next
        boundary's news, so the whole group stops with it. Triton's unload then finds nothing in flight."""
        self.loop.stop()

    def stop(self) -> None:
        """The model is being unloaded: end every session, leave the group, free the model."""
        self._unloading.set()  # a loop failing now must not ask for an unload of a later load
        self.loop.stop()
        self.intake.close()
        leave_group()
        self._free_model()

    def _free_model(self) -> None:
        """Give the model's memory back (the loop has let the engine go), then this rank's claim: a later load may
        start, and the healer may end this process, once it is let go."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with contextlib.suppress(OSError, AttributeError):  # glibc keeps freed heap pages; give them back
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        log.info("rank %d: model freed (RSS now %s)", self.rank, rss())
        self._claim.close()

    def _on_group_failure(self, exc: BaseException) -> None:
        """In-flight streams already got their error: tell the host (a hung peer can hold the group's teardown),
        then leave the group and free the model now (a host may never get to stop this member: see the
        adapter)."""
        if self._unloading.is_set():
            log.error("rank %d: sequence-parallel group failed (%r) while the model unloads", self.rank, exc)
        else:
            self.hooks.on_failure(exc)
        leave_group()
        self._free_model()


def owner_side(rank: int, ranks: int, serving: ServingSettings, engine: WorldModelEngine,
               to_loop: Callable[[mail.LoopLetter], None], inbox: queue.SimpleQueue, hooks: Hooks | None = None,
               books: BooksAddress | None = None) -> Intake:
    """The intake of a rank of `ranks`, with what its thread alone owns beside the streams: the admission's checks,
    the rank's snapshot store and the ledger of its saves, the park tier's store in host memory and the ledger of its
    parked worlds, and a client of the fleet's books (`books`) for its books thread."""
    hooks = hooks or Hooks()
    store = snapshot_store(serving)
    facts = engine.snapshot_facts
    saves = Saves(store, facts, ranks, keep_commits=engine.window_frames != GLOBAL_WINDOW, on_outcome=hooks.on_snapshot)
    root = park_root(serving)
    # No parked world outlives its session: the tier's copies live max_session_s at most.
    memory = None if root is None else SnapshotStore(root, serving.park_memory_bytes, serving.max_session_s)
    parks = Parks(rank, serving, saves, memory, hooks.on_park, hooks.on_parked_bytes)
    return Intake(rank, serving, Admission(serving, engine.spec, facts, store), saves, to_loop, inbox,
                  on_request=hooks.on_request, books=None if books is None else books.connect(), parks=parks)


def snapshot_store(serving: ServingSettings) -> SnapshotStore | None:
    """The snapshot store of this server's settings (None: snapshot_dir is not set, so worlds are not saved)."""
    if not serving.snapshot_dir:
        return None
    return SnapshotStore(Path(serving.snapshot_dir), serving.snapshot_quota_bytes, serving.snapshot_ttl_s)


def rss() -> str:
    """This process's resident memory, where /proc tells it."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
    except (OSError, IndexError, ValueError):
        return "unknown"
    return f"{pages * os.sysconf('SC_PAGE_SIZE') / 2**20:.0f} MB"
