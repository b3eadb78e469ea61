"""What a client reads when its stream fails: plain sentences on what happened and what to do.

The exception itself goes to the server log (the callers log it); clients never see backend text.
"""
from __future__ import annotations

GROUP_FAILED = (
    "The server lost one of its model instances while generating this video, so the stream cannot go on. "
    "Retry once the model is loaded again (the operator reloads it or restarts the server)."
)
MODEL_UNLOADING = "The model is being unloaded, so this stream was stopped. Retry once the model is loaded again."
DECODE_FAILED = (
    "The server could not turn this block into video frames, so the stream stopped here. "
    "Retry the request; if it fails again, ask the operator to look at the server log."
)


def open_failed(exc: BaseException) -> str:
    """A session that could not be opened: memory is the cause a client can act on; the rest is the server's."""
    if "out of memory" in str(exc).lower():
        return (
            "The server has no memory for this video right now. Retry later, or ask for fewer frames or "
            "a smaller height x width."
        )
    return ("The server could not start this video. Retry the request; if it fails again, ask the operator to "
            "look at the server log.")


def session_idle(limit_s: float) -> str:
    return f"the session sent no step for session_idle_timeout_s={limit_s:g} s and was ended; start a new one"


def session_too_long(limit_s: float) -> str:
    return f"the session reached max_session_s={limit_s:g} s and was ended; start a new one"
