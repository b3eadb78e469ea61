"""Watchers: anyone with a world's watch link sees it live, read-only, from the world's one encode (its Broadcast),
with no model work and no slot. A link is a capability: 128 random bits in its id, given to the world's player on
asking, forgotten when the player revokes it or the world ends (its watchers are told why and their connections
close). Bounded before any work: offers per minute on a link, watchers per world and in all, an offer's size; a
watcher that does not connect within CONNECT_WITHIN_S is closed and frees its place.

A watcher's data channel carries the bridge's word to it (why its stream ended); anything the watcher sends on it
is refused (WATCH_READ_ONLY), logged, and its connection closed. Each watcher has a resource token (128 random bits):
a WHEP client ends its own watching with it (`leave`), and no one else can.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
from dataclasses import dataclass, field

from aiortc import RTCDataChannel, RTCPeerConnection

from client.web.broadcast import Broadcast, Viewer
from client.web.codes import (OFFERS_TOO_FAST, WATCH_READ_ONLY, WATCH_UNKNOWN, WATCHER_UNKNOWN, WATCHERS_FULL,
                              Refused)
from client.web.rate import Rate
from client.web.rtc import IceServers, answer, follow_feedback, read_offer

log = logging.getLogger("client.web")
CONNECT_WITHIN_S = 15.0  # an answered watcher's time to connect before its place is freed
FLUSH_S = 1.0  # the longest a last word to a watcher waits to leave before its connection closes


@dataclass(eq=False)
class Watcher:
    pc: RTCPeerConnection
    codec: str  # the video codec its answer sends
    channel: RTCDataChannel | None = None
    resource: str = field(default_factory=lambda: secrets.token_hex(16))  # its WHEP resource's name


@dataclass(eq=False)
class Link:
    id: str
    broadcast: Broadcast
    offers: Rate
    watchers: set[Watcher] = field(default_factory=set)
    reserved: int = 0  # offers being answered: they count against the limits already


def unknown_link() -> Refused:
    return Refused(WATCH_UNKNOWN, "no world is watched with this link: it was revoked, its world ended, or it never "
                                  "existed")


class Watching:
    """The bridge's watch links and their watchers (on the event loop)."""

    def __init__(self, max_watchers: int, max_per_world: int, offers_per_minute: int, ice: IceServers) -> None:
        self.max_watchers, self.max_per_world, self.offers_per_minute = max_watchers, max_per_world, offers_per_minute
        self.ice = ice
        self.links: dict[str, Link] = {}

    @property
    def watchers(self) -> int:
        """Watchers of every world, those being answered included."""
        return sum(len(link.watchers) + link.reserved for link in self.links.values())

    def open(self, broadcast: Broadcast) -> str:
        """A new link to `broadcast`: its id."""
        link_id = secrets.token_hex(16)
        self.links[link_id] = Link(link_id, broadcast, Rate(self.offers_per_minute, 60.0))
        return link_id

    def check(self, link_id: str) -> Link:
        """The link a watcher's offer is for, if it may be answered now; Refused naming why not."""
        link = self.links.get(link_id)
        if link is None:
            raise unknown_link()
        if (wait := link.offers.take()) is not None:
            raise Refused(OFFERS_TOO_FAST, f"more than {self.offers_per_minute} offers a minute on this link",
                          retry_after_s=wait)
        if len(link.watchers) + link.reserved >= self.max_per_world:
            raise Refused(WATCHERS_FULL, f"this world has its {self.max_per_world} watchers; retry later")
        if self.watchers >= self.max_watchers:
            raise Refused(WATCHERS_FULL, f"this player has its {self.max_watchers} watchers; retry later")
        return link

    async def add(self, link: Link, sdp: object) -> Watcher:
        """Answer a watcher's offer on a checked link (sound it asks for answered inactive): the watcher (its answer
        is its pc's localDescription); Refused if the offer is not one to answer or the link went meanwhile."""
        link.reserved += 1
        try:
            offer = read_offer(sdp, audio=True)
            viewer = Viewer(link.broadcast)
            pc = await answer(offer, viewer, self.ice.configuration(f"watch-{link.id[:8]}"))
        finally:
            link.reserved -= 1
        if self.links.get(link.id) is not link:
            await pc.close()
            raise unknown_link()
        watcher = Watcher(pc, offer.codec)
        link.watchers.add(watcher)
        sender = next(sender for sender in pc.getSenders() if sender.track is viewer)  # the video's (audio has none)
        follow_feedback(sender, lambda: link.broadcast.request_keyframe(viewer.codec))

        @pc.on("datachannel")
        def on_channel(channel: RTCDataChannel) -> None:
            watcher.channel = channel
            channel.on("message", lambda message: asyncio.ensure_future(self._refuse_message(link, watcher)))

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState == "failed":
                await self._drop(link, watcher)
            elif pc.connectionState == "closed":  # closed here already (its close emits this)
                link.watchers.discard(watcher)

        asyncio.get_running_loop().call_later(CONNECT_WITHIN_S, self._unless_connected, link, watcher)
        log.info("watcher joined %s… (%d watching it, %d in all)", link.id[:8], len(link.watchers), self.watchers)
        return watcher

    async def leave(self, link_id: str, resource: str) -> None:
        """A watcher's own end (its WHEP resource deleted); Refused (WATCHER_UNKNOWN) unless `resource` names a
        watcher of this link."""
        link = self.links.get(link_id)
        watcher = None if link is None else next(
            (w for w in link.watchers if hmac.compare_digest(w.resource.encode(), resource.encode())), None)
        if watcher is None:
            raise Refused(WATCHER_UNKNOWN, "no watcher has this resource: it ended already, or it never existed")
        await self._drop(link, watcher)

    async def end(self, link_id: str, refusal: Refused) -> int:
        """Forget a link; each of its watchers is told `refusal` and closed. How many there were."""
        link = self.links.pop(link_id, None)
        if link is None:
            return 0
        watchers = list(link.watchers)
        await asyncio.gather(*(self._close(link, w, refusal) for w in watchers))
        log.info("link %s… ended (%s): %d watcher(s) closed", link_id[:8], refusal.code, len(watchers))
        return len(watchers)

    async def _refuse_message(self, link: Link, watcher: Watcher) -> None:
        if watcher not in link.watchers:
            return
        log.warning("a watcher of %s… sent a message on its data channel: refused (%s), its connection closed",
                    link.id[:8], WATCH_READ_ONLY)
        await self._close(link, watcher, Refused(WATCH_READ_ONLY, "watchers cannot steer: this link is read-only"))

    async def _close(self, link: Link, watcher: Watcher, refusal: Refused) -> None:
        link.watchers.discard(watcher)
        channel = watcher.channel
        if channel is not None and channel.readyState == "open":
            channel.send(json.dumps(refusal.message()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._flushed(channel), FLUSH_S)
        await watcher.pc.close()

    @staticmethod
    async def _flushed(channel: RTCDataChannel) -> None:
        while channel.bufferedAmount > 0 and channel.readyState == "open":
            await asyncio.sleep(0.02)

    async def _drop(self, link: Link, watcher: Watcher) -> None:
        if watcher in link.watchers:
            link.watchers.discard(watcher)
            log.info("watcher of %s… left (%d watching it)", link.id[:8], len(link.watchers))
        await watcher.pc.close()

    def _unless_connected(self, link: Link, watcher: Watcher) -> None:
        if watcher.pc.connectionState != "connected":
            asyncio.ensure_future(self._drop(link, watcher))
