"""WebRTC for the bridge (aiortc): a page's offer read and answered with a world's video, the receivers' feedback
routed to the world's one encoder, the ICE servers, and the addresses the media's UDP ports listen on.

A page offers (it is the offerer; the bridge never offers): one video to receive, and a data channel or none. The
bridge answers with H.264 when the offer has a profile it sends, else VP8. It resolves no mDNS candidate (see
`without_mdns_candidates`). ICE: host candidates only unless
`--ice-server` names STUN or TURN servers; the host candidates are on the addresses `bind_media` was given (the
bridge's --host by default: loopback for the default 127.0.0.1; every interface but loopback, aioice's own choice,
for a wildcard host), one UDP port each per peer connection, chosen by the system.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCRtpSender, RTCSessionDescription
from aiortc.codecs import CODECS
from aiortc.rtcpeerconnection import find_common_codecs
from aiortc.rtp import RTCP_PSFB_APP, RTCP_PSFB_FIR, RTCP_PSFB_PLI, RtcpPsfbPacket, unpack_remb_fci
from aiortc.sdp import SessionDescription

from client.web.broadcast import Viewer
from client.web.codes import OFFER_INVALID, SDP_TOO_LARGE, Refused
from client.web.encoder import H264, VP8

MAX_SDP_BYTES = 32 << 10  # Chromium's offer of a video and a data channel is about 6 KB
SENT_CODECS = (H264, VP8)  # in the order the bridge prefers them
TURN_CREDENTIAL_TTL_S = 12 * 3600  # a TURN credential's life (coturn's REST API): a page's longest session
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Offer:
    sdp: str
    codec: str  # the codec the answer sends: the first of SENT_CODECS the offer takes


def read_offer(sdp: object, audio: bool = False) -> Offer:
    """A page's offer, checked before any peer connection exists; Refused (SDP_TOO_LARGE, OFFER_INVALID). With
    `audio`, it may also ask for sound, as WHEP players do: its audio is answered inactive (a world has none)."""
    if not isinstance(sdp, str):
        raise Refused(OFFER_INVALID, "an offer is SDP text")
    if len(sdp.encode()) > MAX_SDP_BYTES:
        raise Refused(SDP_TOO_LARGE, f"the offer is longer than {MAX_SDP_BYTES} bytes")
    try:
        description = SessionDescription.parse(sdp)
    except Exception as exc:  # aiortc's parser raises what it meets (ValueError, KeyError, IndexError, ...)
        raise Refused(OFFER_INVALID, f"the offer is not SDP this bridge reads ({type(exc).__name__})") from None
    kinds = sorted(media.kind for media in description.media)
    taken = [["video"], ["application", "video"]]
    if kinds not in taken + ([sorted(["audio", *k]) for k in taken] if audio else []):
        raise Refused(OFFER_INVALID, f"an offer has one video{', at most one audio' if audio else ''} and at most "
                                     f"one data channel, not {kinds}")
    (video,) = (media for media in description.media if media.kind == "video")
    if video.direction not in ("recvonly", "sendrecv"):
        raise Refused(OFFER_INVALID, f"the offer's video must be received, not {video.direction}")
    sound = [media.direction for media in description.media if media.kind == "audio"]
    if sound and sound[0] not in ("recvonly", "inactive"):  # the bridge takes no media in
        raise Refused(OFFER_INVALID, f"the offer's audio may only be received, not {sound[0]}")
    offered = {codec.mimeType for codec in find_common_codecs(CODECS["video"], video.rtp.codecs)}
    codec = next((mime for mime in SENT_CODECS if mime in offered), None)
    if codec is None:
        raise Refused(OFFER_INVALID, "the offer takes neither H.264 (packetization-mode 1, Baseline) nor VP8")
    return Offer(without_mdns_candidates(sdp), codec)


def without_mdns_candidates(sdp: str) -> str:
    """The offer without its mDNS host candidates (NAME.local, as browsers hide their addresses) and, if it had
    any, without its end of candidates. aioice would resolve each name by multicast (a socket on port 5353 of every
    interface, and up to a second's wait before the answer); the bridge learns the page's address from the page's
    own connectivity checks instead (peer-reflexive candidates), which go on while no end of candidates came."""
    lines = sdp.splitlines(keepends=True)
    kept = [line for line in lines if not (line.startswith("a=candidate:") and ".local " in line)]
    if len(kept) < len(lines):
        kept = [line for line in kept if not line.startswith("a=end-of-candidates")]
    return "".join(kept)


async def answer(offer: Offer, viewer: Viewer, configuration: RTCConfiguration) -> RTCPeerConnection:
    """A peer connection that sends `viewer` in `offer`'s codec; its answer is its localDescription. Refused
    (OFFER_INVALID) when aiortc cannot answer the offer (nothing is left open then)."""
    pc = RTCPeerConnection(configuration)
    transceiver = pc.addTransceiver(viewer, direction="sendonly")
    transceiver.setCodecPreferences([c for c in RTCRtpSender.getCapabilities("video").codecs
                                     if c.mimeType in (offer.codec, "video/rtx")])
    try:
        await pc.setRemoteDescription(RTCSessionDescription(offer.sdp, "offer"))
        await pc.setLocalDescription(await pc.createAnswer())
    except asyncio.CancelledError:  # the page went meanwhile
        asyncio.ensure_future(pc.close())
        raise
    except Exception as exc:  # the offer passed the parser but not aiortc's checks (ICE or DTLS fields missing, ...)
        await pc.close()
        raise Refused(OFFER_INVALID, f"the offer could not be answered: {exc}") from None
    viewer.codec = offer.codec
    return pc


def follow_feedback(sender: RTCRtpSender, on_keyframe: Callable[[], None],
                    on_bitrate: Callable[[int], None] | None = None) -> None:
    """Route a receiver's keyframe requests (PLI, FIR) and, with on_bitrate, its bitrate estimate (REMB) to the
    world's encoder: aiortc's sender applies them to an encoder of its own, which a sender of packets never uses."""
    handle: Callable[[object], Awaitable[None]] = sender._handle_rtcp_packet

    async def tap(packet: object) -> None:
        if isinstance(packet, RtcpPsfbPacket) and packet.fmt in (RTCP_PSFB_PLI, RTCP_PSFB_FIR):
            on_keyframe()
        elif isinstance(packet, RtcpPsfbPacket) and packet.fmt == RTCP_PSFB_APP and on_bitrate is not None:
            try:
                bitrate, ssrcs = unpack_remb_fci(packet.fci)
            except ValueError:
                bitrate, ssrcs = 0, []
            if sender._ssrc in ssrcs:
                on_bitrate(bitrate)
        await handle(packet)

    sender._handle_rtcp_packet = tap


@dataclass(frozen=True)
class IceServers:
    """--ice-server URLs (stun:, turn:, turns:) and the TURN server's shared secret (coturn's static-auth-secret):
    each peer connection, the bridge's and the page's, gets a TURN credential of its own that expires."""

    urls: tuple[str, ...] = ()
    turn_secret: bytes | None = None

    def __post_init__(self) -> None:
        if any(url.startswith(("turn:", "turns:")) for url in self.urls) and self.turn_secret is None:
            raise ValueError("a TURN server (--ice-server turn:...) needs its shared secret: --turn-secret-file")

    def for_page(self, name: str, now: float | None = None) -> list[dict[str, str | list[str]]]:
        """RTCPeerConnection's iceServers, for a peer called `name` (a session id: the TURN server logs it)."""
        stun = [url for url in self.urls if url.startswith("stun:")]
        turn = [url for url in self.urls if not url.startswith("stun:")]
        servers: list[dict[str, str | list[str]]] = [{"urls": stun}] if stun else []
        if turn:
            assert self.turn_secret is not None
            username = f"{int((time.time() if now is None else now) + TURN_CREDENTIAL_TTL_S)}:{name}"
            credential = base64.b64encode(hmac.new(self.turn_secret, username.encode(), hashlib.sha1).digest())
            servers.append({"urls": turn, "username": username, "credential": credential.decode()})
        return servers

    def configuration(self, name: str) -> RTCConfiguration:
        """The bridge's side of a peer connection called `name`."""
        return RTCConfiguration([RTCIceServer(**server) for server in self.for_page(name)])


def media_addresses(host: str) -> list[str] | None:
    """The addresses of the bridge's host candidates for --host `host`: its own addresses; None (every interface
    but loopback) for a wildcard."""
    if host in WILDCARD_HOSTS:
        return None
    try:
        return [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:  # a name: what it resolves to
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_UDP)})


def bind_media(addresses: list[str] | None) -> None:
    """Host candidates on `addresses` only (None: aioice's choice). aioice takes its addresses from one function and
    has no setting for them; the bridge is one process with one choice, made at its start."""
    if addresses is not None:
        aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: [
            address for address in addresses if (":" in address and use_ipv6) or (":" not in address and use_ipv4)]
