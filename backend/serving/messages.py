"""What a client reads when its stream fails: plain sentences on what happened and what to do.

The exception itself goes to the server log (the callers log it); clients never see backend text.
"""
from __future__ import annotations

import dataclasses

from ..api import contract as c
from ..api.refusal import Refusal

HEAL_S = 20.0  # a failed group's reload, as measured (bench/README, the kill matrix): a group-failed retry hint
UNLOAD_S = 10.0  # an unload, then the server's own restart or reload: a stopping server's retry hint

GROUP_FAILED = Refusal(
    c.GROUP_FAILED,
    "The server lost one of its model instances while generating this video, so the stream cannot go on. "
    "The server reloads the model by itself: retry in a little while.",
    HEAL_S,
)
MODEL_UNLOADING = Refusal(
    c.SERVER_STOPPING, "The model is being unloaded, so this stream was stopped. Retry once the model is loaded "
    "again.", UNLOAD_S)
RELOAD_REFUSED = Refusal(
    c.RELOAD_REFUSED, "This server's model instances are serving: a load now would start a second group on the same "
    "rendezvous port beside the one that serves. Unload the model first (its sessions end), then load it; the "
    "loaded version goes on serving meanwhile.")
DECODE_FAILED = Refusal(
    c.DECODE_FAILED,
    "The server could not turn this block into video frames, so the stream stopped here. "
    "Retry the request; if it fails again, ask the operator to look at the server log.",
)
OPEN_RETRY_S = 30.0  # an out-of-memory open: other sessions end meanwhile


def open_failed(exc: BaseException) -> Refusal:
    """A session that could not be opened: memory is the cause a client can act on; the rest is the server's."""
    if "out of memory" in str(exc).lower():
        return Refusal(c.OUT_OF_MEMORY, "The server has no memory for this video right now. Retry later, or ask "
                       "for fewer frames or a smaller height x width.", OPEN_RETRY_S)
    return Refusal(c.OPEN_FAILED, "The server could not start this video. Retry the request; if it fails again, ask "
                   "the operator to look at the server log.")


def session_idle(limit_s: float) -> Refusal:
    return Refusal(c.EXPIRED, f"the session sent no step for session_idle_timeout_s={limit_s:g} s and was ended; "
                   "start a new one")


def session_too_long(limit_s: float, by_key: bool = False) -> Refusal:
    """by_key: the limit is its key's session_s (the keys file), shorter than the server's max_session_s."""
    limit = f"its key's session_s={limit_s:g} s" if by_key else f"max_session_s={limit_s:g} s"
    return Refusal(c.EXPIRED, f"the session reached {limit} and was ended; start a new one")


def user_session_limit(name: str, sessions: int | None, queue: int | None) -> Refusal:
    limits = ", ".join(f"{k}={v}" for k, v in (("sessions", sessions), ("queue", queue)) if v is not None)
    return Refusal(c.USER_SESSION_LIMIT, f"key {name} has its limit of sessions running and waiting ({limits}); "
                   "end one of them first")


BOOKS_RETRY_S = 5.0  # a store that did not answer: the fleet's books are back within a restart, or an operator's fix
BOOKS_UNAVAILABLE = Refusal(c.BOOKS_UNAVAILABLE, "the fleet's books (where every key's quotas are kept across its "
                            "groups) did not answer, so no new session of a key with limits is admitted now; running "
                            "sessions go on", BOOKS_RETRY_S)


def quota_exhausted(name: str, blocks_per_hour: int, retry_after_s: float) -> Refusal:
    return Refusal(c.QUOTA_EXHAUSTED, f"key {name} has used its blocks_per_hour={blocks_per_hour}; retry after "
                   "retry_after_s", retry_after_s)


def queue_full(max_queue: int, max_sessions: int, retry_after_s: float) -> Refusal:
    return Refusal(c.CAPACITY_EXHAUSTED, f"server busy: {max_queue} sessions already wait for a slot "
                   f"(max_queue={max_queue}, max_sessions={max_sessions}); retry after retry_after_s", retry_after_s)


NEVER_STARTED = Refusal(c.SESSION_UNKNOWN, "it never started here (send the start flag first)")
ENDED_BY_FLAG = Refusal(c.SESSION_UNKNOWN, "it was ended by its end flag; start a new one")


def session_exists(key: str) -> Refusal:
    return Refusal(c.SESSION_EXISTS, f"session {key} is already running; send steps without the start flag, or end "
                   "it first")


def no_session(key: str, ending: Refusal, pause: bool = False) -> Refusal:
    """A step of sequence `key` that no running session takes; `ending`: how its last one ended (or that none
    began), whose code and retry time it keeps."""
    prefix = f"request parameter '{c.PARAM_PAUSE}': " if pause else ""
    return dataclasses.replace(ending, sentence=f"{prefix}no running session {key}: {ending.sentence}")


DRAIN_RETRY_S = 1.0  # a draining group has left the balancer's rotation: a retry through it lands elsewhere
DRAINING = Refusal(c.SERVER_STOPPING, "this group is draining (an operator's restart or move) and takes no new "
                   "session; retry through the same address, which sends you to another group", DRAIN_RETRY_S)


def moved(snapshot_id: str) -> Refusal:
    return Refusal(c.MOVED, "this group is draining (an operator's restart or move): your world was saved and goes "
                   f"on where you resume it (request parameter resume={snapshot_id}), then send again the steps "
                   "after its last block", snapshot_id=snapshot_id)


def save_failed(snapshot_id: str) -> Refusal:
    return Refusal(c.SNAPSHOT_SAVE_FAILED, f"snapshot {snapshot_id} could not be written (the server log says why); "
                   "the session goes on: save again")


def not_saved(snapshot_id: str) -> Refusal:
    return Refusal(c.SNAPSHOT_SAVE_FAILED, f"snapshot {snapshot_id} was not saved: the session ended before the "
                   "block it was to follow")


NO_SNAPSHOT_DIR = Refusal(c.INVALID_INPUT, "this server keeps no snapshots (its snapshot_dir is not set): request "
                          "parameters 'save' and 'resume' need one")


def park_full(max_parked: int, park_after_s: float) -> Refusal:
    """A park past max_parked (the owner logs it and tries again park_after_s later; its client is told nothing: its
    world stays on its slot)."""
    return Refusal(c.CAPACITY_EXHAUSTED, f"max_parked={max_parked} worlds are parked in this group: the world stays on "
                   "its slot", park_after_s)
