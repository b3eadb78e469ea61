"""Claims one process of a host holds until it lets go or exits: the name of an abstract unix socket, which the
kernel frees with its process (nothing to clean up after a SIGKILL). A host is a network namespace."""
from __future__ import annotations

import socket


def claim_for_this_host(name: str) -> socket.socket | None:
    """The claim on `name` (close it to let go), or None: another process of this host holds it."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind("\0" + name)
    except OSError:
        claim.close()
        return None
    return claim


MEMBER = "lingbot-member"  # a group member's claim on its rank: MEMBER-<rendezvous port>-<rank>


def member_claim(rendezvous_port: int, rank: int) -> str:
    """The claim a member holds on its rank of the group at `rendezvous_port`, from its start until it has left the
    group and freed the model."""
    return f"{MEMBER}-{rendezvous_port}-{rank}"
