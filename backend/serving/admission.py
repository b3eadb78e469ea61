"""The one admission step: a request, its inputs checked against the contract at parse, is checked against this
server (its limits, then the engine's settings and geometry) once, on the rank that received it. What it
resolves travels in the shared session record, so no other rank checks it again."""
from __future__ import annotations

import dataclasses
import logging

from ..api.contract import NO_FORK, PARAM_RECACHE, block_video_frames
from ..api.errors import InputError
from ..api.request import Controls, ResumeRequest, SessionRequest, StepRequest
from ..engine.snapshot.restore import SharedState, read_shared
from ..engine.snapshot.sessions import SnapshotFacts
from ..engine.snapshot.store import SnapshotStore, not_yours
from ..engine.validation import GLOBAL_WINDOW, EngineSpec, request_geometry
from . import messages
from .settings import ServingSettings
from .keys import ANONYMOUS, Principal
from .sessions import ResumeFrom, SharedSession, Step

log = logging.getLogger(__name__)


class Admission:
    """This server's checks of a request (the intake's, on the owning rank): its limits, then the engine's
    settings and geometry, and a resume's snapshot. Holds the engine's spec and what a snapshot's fit depends on,
    not the engine: the weights may go while requests arrive."""

    def __init__(self, limits: ServingSettings, spec: EngineSpec, facts: SnapshotFacts | None = None,
                 store: SnapshotStore | None = None) -> None:
        """facts: engine.snapshot_facts; store: the rank's snapshot store (the intake's, which also saves into it),
        where snapshot_dir is set (else a resume is refused)."""
        self.limits, self.spec, self.facts, self.store = limits, spec, facts, store

    def session(self, request: SessionRequest, session_id: str, owner: int,
                principal: Principal = ANONYMOUS) -> SharedSession:
        """The session record every rank plans over; raises InputError naming the input."""
        check_limits(request, self.limits)
        return SharedSession.submitted(session_id, request, request_geometry(self.spec, request), owner, principal)

    def step(self, step: StepRequest) -> None:
        """A step's camera against the server's block (4 x block_frames new video frames), and its recache
        against the server's window: with global attention a recache would recompute every frame of the
        session."""
        if step.controls is not None:
            self._check_controls(step.controls)

    def _check_controls(self, controls: Controls) -> None:
        controls.check_frames(block_video_frames(self.spec.settings.block_frames, first=False))
        if controls.recache and self.spec.window_frames == GLOBAL_WINDOW:
            raise InputError(f"request parameter '{PARAM_RECACHE}' needs a sliding window: this server runs "
                             f"window_frames={GLOBAL_WINDOW} (global attention), where a recache would recompute "
                             "every frame of the session")

    def resume(self, resume: ResumeRequest, session_id: str, owner: int,
               principal: Principal) -> tuple[SharedSession, SharedState]:
        """A session opened from its snapshot: the store finds it (its id's form checked before any path is
        built), its settings must be this server's, its own file is read (its SHA-256 checked) for the saved
        request, which then meets this server's limits like a new one. Returns the session and what was read of
        its snapshot's shared file (its owner opens the session from it: the file is read once here). SnapshotError
        or InputError, with its code (SNAPSHOT_NOT_YOURS: another key's, not shared)."""
        snapshot = self._store().open(resume.snapshot_id)
        if not self._store().ownership(resume.snapshot_id).opens_for(principal.digest):
            raise not_yours(resume.snapshot_id, "resuming or forking it needs its owner to share it")
        self.facts.check_fits(snapshot)
        saved = read_shared(snapshot)
        if 0 < saved.request.max_blocks <= saved.block_index:
            raise InputError(f"snapshot {resume.snapshot_id} was saved after its session's last block "
                             f"(max_blocks={saved.request.max_blocks}): there is nothing left to play")
        request = dataclasses.replace(saved.request, sequence_id=resume.sequence_id, save=False,
                                      return_latents=resume.return_latents, return_used=resume.return_used)
        check_limits(request, self.limits)
        geometry = request_geometry(self.spec, request)
        self._check_controls(resume.controls)
        fork = None if resume.fork_seed == NO_FORK else resume.fork_seed
        start = ResumeFrom(resume.snapshot_id, snapshot.manifest.to_text(), saved.block_index, fork)
        return SharedSession.resumed(session_id, request, geometry, owner, principal, start, Step(resume.controls)), saved

    def _store(self) -> SnapshotStore:
        if self.store is None:
            raise InputError(messages.NO_SNAPSHOT_DIR.sentence)
        return self.store


def check_limits(request: SessionRequest, limits: ServingSettings) -> None:
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
