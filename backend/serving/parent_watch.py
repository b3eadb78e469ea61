"""A model instance's stub ends with its server: Triton's Python backend runs each instance in a stub process of the
tritonserver's, and a stub whose server is gone without a word (its launcher killed outright, so the server's stop never
ran) would live on, holding its rank's claim, its sockets and, on rank 0, the group's rendezvous port: the group could
not start again on this host. A thread watches the stub's parent and the process that started its server (its
launcher, named in SERVER_OWNER_VARIABLE), and ends the stub once either is gone."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

SERVER_OWNER_VARIABLE = "LINGBOT_SERVER_OWNER"  # the pid of the process that started the server (launch/server.py)
EVERY_S = 0.5  # how often they are looked at


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def watch_parent(every_s: float = EVERY_S) -> threading.Thread:
    """Start the watch (the thread `lingbot-parent-watch`): once this process has been handed to another parent (its
    own died), or the server's owner is gone, it exits at once, status 1."""
    parent = os.getppid()
    owner = int(os.environ.get(SERVER_OWNER_VARIABLE) or 0)

    def watch() -> None:
        while os.getppid() == parent and (not owner or alive(owner)):
            time.sleep(every_s)
        # Not through logging: its handler sends to the dead server, a send that never returns, and another thread
        # may hold the handler's lock, stuck in one already.
        os.write(2, b"lingbot_world: this model instance's server or its launcher is gone: its stub exits\n")
        os._exit(1)

    thread = threading.Thread(target=watch, name="lingbot-parent-watch", daemon=True)
    thread.start()
    return thread
