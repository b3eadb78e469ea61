"""A fixed delay for the packets an iptables NFQUEUE rule queues: each is accepted `delay` after it was queued, in
order. This machine's kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so the bad link's delay is this, over
netfilter's queue (nfnetlink_queue, spoken here over a raw netlink socket: no library). Run it where the rule is
(`ip netns exec NS python -m bench.link_delay --queue N --delay-ms MS`); it prints "ready" once bound, and runs
until killed.
"""
from __future__ import annotations

import argparse
import heapq
import socket
import struct
import sys
import threading
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS = 1, 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLMSG_ERROR = 2


def _attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def _message(kind: int, queue: int, attrs: bytes, seq: int) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, NLM_F_REQUEST, seq, 0) + body


def _packet_ids(data: bytes):
    """The ids of the queued packets in one netlink read."""
    at = 0
    while at + 16 <= len(data):
        size, kind = struct.unpack_from("=IH", data, at)
        if size < 16:
            return
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            a = at + 20  # past nlmsghdr (16) and nfgenmsg (4)
            while a + 4 <= at + size:
                length, attr = struct.unpack_from("=HH", data, a)
                if length < 4:
                    break
                if attr & 0x7FFF == NFQA_PACKET_HDR:
                    yield struct.unpack_from("!I", data, a + 4)[0]
                a += (length + 3) & ~3
        elif kind == NLMSG_ERROR and struct.unpack_from("=i", data, at + 16)[0] != 0:
            raise OSError(-struct.unpack_from("=i", data, at + 16)[0], "nfnetlink_queue refused a message")
        at += (size + 3) & ~3


def run(queue: int, delay_s: float) -> None:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((0, 0))
    sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0,
                                                                                   socket.AF_INET)), 1))
    sock.send(_message(NFQNL_MSG_CONFIG, queue, _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)), 2))
    due: list[tuple[float, int]] = []
    ready = threading.Condition()

    def release() -> None:
        while True:
            with ready:
                while not due or due[0][0] > time.monotonic():
                    ready.wait(None if not due else due[0][0] - time.monotonic())
                _, packet = heapq.heappop(due)
            sock.send(_message(NFQNL_MSG_VERDICT, queue,
                               _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet)), 0))

    threading.Thread(target=release, daemon=True).start()
    print("ready", flush=True)
    while True:
        data = sock.recv(1 << 16)
        now = time.monotonic()
        with ready:
            for packet in _packet_ids(data):
                heapq.heappush(due, (now + delay_s, packet))
            ready.notify()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=int, required=True, help="the NFQUEUE rule's --queue-num")
    parser.add_argument("--delay-ms", type=float, required=True, help="each packet's delay")
    args = parser.parse_args(argv)
    try:
        run(args.queue, args.delay_ms / 1000)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
