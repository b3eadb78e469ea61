"""Serving limits and group settings (config.pbtxt `parameters` beside the engine's; torch-free)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..api.contract import MAX_INPUT_PIXELS
from ..api.errors import ConfigError
from ..api.settings import from_parameters, parameter_fields
from ..engine.settings import EngineSettings


@dataclass(frozen=True)
class ServingSettings:
    """Limits and group settings of the Triton model (config.pbtxt `parameters` beside the engine's)."""

    max_frames: int = 321  # video frames per request
    max_pixels: int = 1280 * 1280  # height x width per request
    max_input_pixels: int = MAX_INPUT_PIXELS  # the first-frame image's own height x width, before it is resized
    max_sessions: int = 4  # sessions generating at once (each holds a KV cache)
    max_queue: int = 16  # sessions waiting for a slot; more are rejected
    max_batch: int = 4  # sessions of one geometry run in one forward
    max_blocks_ahead: int = 2  # blocks a session may be computed ahead of what its client was sent
    host_rank: int = 0  # this server's place among the servers of one group (one per host under mpirun)
    host_count: int = 1  # servers in the group; each runs the same number of instances
    rendezvous_host: str = "127.0.0.1"  # where global rank 0 hosts the TCP store (its host's address)
    rendezvous_port: int = 29650  # the TCP store's port on rendezvous_host (global rank 0)
    init_timeout_s: float = 1800.0  # rendezvous and weight loading
    collective_timeout_s: float = 120.0  # a rank silent this long is declared failed
    session_idle_timeout_s: float = 60.0  # a steered session without a step this long is ended
    max_session_s: float = 3600.0  # a steered session is ended after this long in all
    sequence_slots: int = 4096  # Triton sequences held at once (a refused or abandoned start holds one a while)
    snapshot_dir: str = ""  # where saved worlds live (docs/worlds.md), shared by every group that resumes them; "":
    # saving and resuming are off (the launcher sets <its model repository>/../snapshots unless told otherwise)
    snapshot_quota_bytes: int = 400 * 2**30  # the most the snapshots take: the 14B model at 480x832 writes 27 GiB a
    # snapshot (docs/worlds.md) and a played world keeps 3 (its base, the one before, a save under way: the
    # clients' periodic saves release older ones), so max_sessions' 4 worlds hold ~324 GiB; a save past it is refused
    # at once
    books_lease_s: float = 15.0  # where groups share the fleet's books: a session's lease there lives this long unless
    # its owner renews it (every third of it), so a group that dies frees its keys' counts within it (docs/security.md)
    snapshot_ttl_s: float = 86400.0  # how long a snapshot lives after its save: a day, so a player who left may come
    # back the next day; the oldest go first
    park_after_s: float = 5.0  # a steered world that has asked for no block this long is parked off its slot
    # (docs/serving.md, "Parking"); 0: never. A world parks once it has waited as long as its return would cost (rent
    # or buy): an unpark from host memory at the 14B geometry is 1.2 s at SP4, 4.7 s at SP1 (estimated: bench/README
    # section 22); on the CPU bench 5 s lets 8 players share 2 slots, 10 s turns 3 away
    park_memory_bytes: int = 336 * 2**30  # the park tier's host memory (park_memory_dir): max_parked's 12 worlds of
    # the 14B model at 480x832 reserve 27,699 MiB each (a full window: docs/worlds.md), 325 GiB; past it a park goes
    # to the snapshot store
    park_memory_dir: str = ""  # the folder on a tmpfs (host memory) that holds this group's parked worlds, emptied at
    # each load; "": parks go to the snapshot store alone (the launcher sets a folder under /dev/shm on one host)
    max_parked: int = 12  # parked worlds per group (they hold no slot, only their copy): 3 for each of max_sessions'
    # 4 slots (the CPU bench's 8 players on 2 slots had up to 7 parked at once at park_after_s 5 s); a park past it is
    # refused and the world stays on its slot

    def __post_init__(self) -> None:
        if not self.books_lease_s >= 1.0:
            raise ConfigError(f"books_lease_s={self.books_lease_s} must be at least 1 s (its renewals come every third "
                              "of it)")
        if not 0 <= self.host_rank < self.host_count:
            raise ConfigError(f"host_rank={self.host_rank} must be in [0, host_count={self.host_count})")
        if self.park_after_s < 0 or self.park_memory_bytes < 0 or self.max_parked < 0:
            raise ConfigError(f"park_after_s={self.park_after_s:g}, park_memory_bytes={self.park_memory_bytes} and "
                              f"max_parked={self.max_parked} must not be negative")


def split_parameters(params: Mapping[str, str]) -> tuple[EngineSettings, ServingSettings]:
    """The engine's and the serving layer's settings from one set of config.pbtxt parameters."""
    serving_names = {f.name for f in parameter_fields(ServingSettings)}
    serving = {k: v for k, v in params.items() if k in serving_names}
    engine = {k: v for k, v in params.items() if k not in serving_names}
    return from_parameters(EngineSettings, engine), from_parameters(ServingSettings, serving)
