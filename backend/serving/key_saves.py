"""A key's own snapshots, as its key asks about them (request parameter saves): the list with their sizes, and
sharing one with every key that holds its id, or taking it back. On the owner's intake thread, which owns the rank's
snapshot store."""
from __future__ import annotations

import json

from ..api.errors import InputError
from ..api.request import SavesRequest
from ..engine.snapshot.manifest import SnapshotError
from ..engine.snapshot.store import SnapshotStore
from . import messages
from .keys import Principal
from .streams import Responder

NO_KEYS = ("this server has no keys file, so its snapshots have no owner to list them for: their ids are the only "
           "way to them")


def answer(store: SnapshotStore | None, request: SavesRequest, who: Principal, responder: Responder) -> None:
    """The request answered at once: the key's snapshots after the change it asks for, or its refusal (no store, no
    key: INVALID_INPUT; SNAPSHOT_UNKNOWN, SNAPSHOT_NOT_YOURS)."""
    try:
        responder.send_saves(listing(store, request, who))
    except (InputError, SnapshotError) as exc:
        responder.send_error(exc.refusal)


def listing(store: SnapshotStore | None, request: SavesRequest, who: Principal) -> str:
    """The key's snapshots as the output `saves` carries them, after the change `request` asks for."""
    if store is None:
        raise InputError(messages.NO_SNAPSHOT_DIR.sentence)
    if not who.digest:
        raise InputError(NO_KEYS)
    if request.action in ("share", "unshare"):
        store.share(request.snapshot_id, who.digest, request.action == "share")
    saved, held = store.saves_of(who.digest)
    return json.dumps({"key": who.name, "bytes": held, "quota_bytes": who.quota.snapshot_bytes,
                       "snapshots": [{"id": s.snapshot_id, "bytes": s.bytes, "created_unix_s": round(s.created_unix_s, 3),
                                      "shared": s.shared} for s in saved]})
