"""The one admission step: a request, its inputs checked against the contract at parse, is checked against this
server (its limits, then the engine's settings and geometry) once, on the rank that received it. What it
resolves travels in the shared session record, so no other rank checks it again."""
from __future__ import annotations

from ..api.contract import PARAM_RECACHE, block_video_frames
from ..api.errors import InputError
from ..api.request import SessionRequest, StepRequest
from ..engine.validation import GLOBAL_WINDOW, EngineSpec, request_geometry
from .config import ServingConfig
from .keys import ANONYMOUS, Principal
from .sessions import SharedSession


class Admission:
    """This server's checks of a request (the intake's, on the owning rank): its limits, then the engine's
    settings and geometry. Holds the engine's spec, not the engine: the weights may go while requests still
    arrive."""

    def __init__(self, limits: ServingConfig, spec: EngineSpec) -> None:
        self.limits, self.spec = limits, spec

    def session(self, request: SessionRequest, session_id: str, owner: int,
                principal: Principal = ANONYMOUS) -> SharedSession:
        """The session record every rank plans over; raises InputError naming the input."""
        check_limits(request, self.limits)
        return SharedSession.submitted(session_id, request, request_geometry(self.spec, request), owner, principal)

    def step(self, step: StepRequest) -> None:
        """A step's camera against the server's block (4 x block_frames new video frames), and its recache
        against the server's window: with global attention a recache would recompute every frame of the
        session."""
        if step.controls is None:
            return
        step.controls.check_frames(block_video_frames(self.spec.config.block_frames, first=False))
        if step.controls.recache and self.spec.window_frames == GLOBAL_WINDOW:
            raise InputError(f"request parameter '{PARAM_RECACHE}' needs a sliding window: this server runs "
                             f"window_frames={GLOBAL_WINDOW} (global attention), where a recache would recompute "
                             "every frame of the session")


def check_limits(request: SessionRequest, limits: ServingConfig) -> None:
    """The request's size against the serving limits, first. The image is judged by its shape alone, before
    anything copies or resizes it."""
    image_h, image_w = request.image.shape[:2]
    if image_h * image_w > limits.max_input_pixels:
        raise InputError(f"image is {image_h} x {image_w} pixels, more than max_input_pixels="
                         f"{limits.max_input_pixels}; send a smaller picture")
    if request.num_frames is not None and not 1 <= request.num_frames <= limits.max_frames:
        raise InputError(f"num_frames={request.num_frames} must be between 1 and max_frames={limits.max_frames}")
    if request.height * request.width > limits.max_pixels:
        raise InputError(
            f"width x height = {request.width} x {request.height} = {request.width * request.height} pixels "
            f"is more than max_pixels={limits.max_pixels}"
        )
