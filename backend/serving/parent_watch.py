"""A model instance's stub ends with its server: Triton's Python backend runs each instance in a stub process of the
tritonserver's, and a stub whose server is gone without a word (its launcher killed outright, so the server's stop never
ran) would live on, holding its rank's claim, its sockets and, on rank 0, the group's rendezvous port: the group could
not start again on this host. A thread watches the stub's parent and ends the process once it is gone."""
from __future__ import annotations

import logging
import os
import threading
import time

EVERY_S = 0.5  # how often the parent is looked at
log = logging.getLogger(__name__)


def watch_parent(every_s: float = EVERY_S) -> threading.Thread:
    """Start the watch of this process's parent (the thread `lingbot-parent-watch`): once the process has been
    handed to another parent (its own died), it exits at once, status 1."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        log.error("the server (pid %d) of this model instance is gone: its stub exits", parent)
        os._exit(1)

    thread = threading.Thread(target=watch, name="lingbot-parent-watch", daemon=True)
    thread.start()
    return thread
