"""A model instance's stub ends with its server: Triton's Python backend runs each instance in a stub process of the
tritonserver's, and a stub whose server is gone without a word (its launcher killed outright, so the server's stop never
ran) would live on, holding its rank's claim, its sockets and, on rank 0, the group's rendezvous port: the group could
not start again on this host. A thread watches the stub's parent and ends the process once it is gone."""
from __future__ import annotations

import os
import threading
import time

EVERY_S = 0.5  # how often the parent is looked at


def watch_parent(every_s: float = EVERY_S) -> threading.Thread:
    """Start the watch of this process's parent (the thread `lingbot-parent-watch`): once the process has been
    handed to another parent (its own died), it exits at once, status 1."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        # Not through logging: its handler sends to the dead server, a send that never returns, and another thread
        # may hold the handler's lock, stuck in one already.
        os.write(2, f"lingbot_world: the server (pid {parent}) of this model instance is gone: its stub exits\n".encode())
        os._exit(1)

    thread = threading.Thread(target=watch, name="lingbot-parent-watch", daemon=True)
    thread.start()
    return thread
