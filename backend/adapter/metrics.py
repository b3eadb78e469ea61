"""Prometheus metrics of the served streams, on Triton's metrics endpoint (one label set per rank)."""
from __future__ import annotations

from collections.abc import Mapping

import triton_python_backend_utils as pb_utils

from ..model.layout import Setting
from ..serving.waits import QueueCounts

LATENCY_BUCKETS_S = [0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0]
QUEUE_BUCKETS_S = [0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0]
# A park's copy: milliseconds on the tiny model, ~20 s at the 14B geometry (27 GiB with its SHA-256s: bench/README).
PARK_BUCKETS_S = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0]
SESSION_STATES = ("pending", "active", "ending", "parked")
PARK_EVENTS = ("parked", "unparked", "refused", "failed")


class StreamMetrics:
    """Families are kept on the object: Triton drops a family's metrics when it is garbage-collected. It is as wide
    as the metrics it serves (an attribute for each, 28): every one is a counter, gauge or histogram that some hook
    bumps, so a narrower class would only hide them in a table."""

    def __init__(self, model_name: str, rank: int) -> None:
        labels = {"model": model_name, "rank": str(rank)}
        self._labels = labels
        family = pb_utils.MetricFamily
        self._families = [
            family("lingbot_world_blocks_total", "AR blocks sent to clients", family.COUNTER),
            family("lingbot_world_stream_errors_total", "streams ended by an error response", family.COUNTER),
            family("lingbot_world_streams_open", "streams this instance is answering", family.GAUGE),
            family("lingbot_world_time_to_first_block_seconds", "request arrival to first block sent", family.HISTOGRAM),
            family("lingbot_world_inter_block_seconds", "between two blocks of one stream", family.HISTOGRAM),
            family("lingbot_world_block_dit_seconds", "DiT time of a block (all its forwards)", family.HISTOGRAM),
            family("lingbot_world_step_latency_seconds", "a steered session's request to its block sent",
                   family.HISTOGRAM),
            family("lingbot_world_held_blocks_total", "steered blocks run on held controls (late steps)",
                   family.COUNTER),
            family("lingbot_world_blocks_run_total", "session blocks this rank computed (every rank runs every block)",
                   family.COUNTER),
            family("lingbot_world_loop_cpu_seconds_total",
                   "CPU of the group loop's thread outside run_block (the control plane)", family.COUNTER),
            family("lingbot_world_prompt_events_total", "prompt events (a steered step's new prompt) applied",
                   family.COUNTER),
            family("lingbot_world_prompt_cache_hits_total", "prompt events whose prompt the prompt cache held (no encode)",
                   family.COUNTER),
            family("lingbot_world_sessions_ended_total", "sessions this instance owned that ended, by reason (as logged)",
                   family.COUNTER),
            family("lingbot_world_refusals_total", "error responses this instance sent, by code", family.COUNTER),
            family("lingbot_world_queue_seconds", "a session's wait for its slot, from its request (this instance's)",
                   family.HISTOGRAM),
            # The group's own counts: the same on every rank, so rank 0 alone publishes them.
            family("lingbot_world_sessions", "the group's sessions by state (rank 0)", family.GAUGE),
            family("lingbot_world_queue_depth", "the group's sessions waiting for a slot (rank 0)", family.GAUGE),
            family("lingbot_world_free_slots", "the group's free session slots, max_sessions minus those held (rank 0)",
                   family.GAUGE),
            # By key name (a server with a keys file; never the key): this instance's requests, blocks, refusals.
            family("lingbot_world_key_requests_total", "requests a key opened the door for", family.COUNTER),
            family("lingbot_world_key_blocks_total", "AR blocks sent to a key's sessions", family.COUNTER),
            family("lingbot_world_key_refusals_total", "error responses to a key's requests, by code", family.COUNTER),
            # Saved worlds (docs/worlds.md), of the sessions this instance owns.
            family("lingbot_world_snapshots_total", "snapshots of this instance's sessions by event: saved, failed "
                   "(a save that could not be written), resumed (a session opened from one)", family.COUNTER),
            family("lingbot_world_drains_total", "drains this instance took part in (its launcher's restart or "
                   "move; each of its steered sessions then ends 'moved')", family.COUNTER),
        ]
        (blocks, errors, streams, first, inter, dit, step, held, run, loop_cpu, events, hits, ended, refusals, queued,
         sessions, depth, free, *by_key, snapshots, drains) = self._families
        self._by_key = dict(zip(("requests", "blocks", "refusals"), by_key))
        # (family, key name[, code]) -> its metric, made on first use: by the intake's thread alone, which counts a
        # key's requests, blocks and refusals (each dict of metrics made on first use has one thread that fills it)
        self._key_metrics: dict[tuple[str, ...], object] = {}
        self.blocks = blocks.Metric(labels=labels)
        self.errors = errors.Metric(labels=labels)
        self.streams_open = streams.Metric(labels=labels)
        # Triton keeps a family's values across a model's reload and past a killed stub: start from zero.
        self.streams_open.set(0.0)
        self.time_to_first_block = first.Metric(labels=labels, buckets=LATENCY_BUCKETS_S)
        self.inter_block = inter.Metric(labels=labels, buckets=LATENCY_BUCKETS_S)
        self.block_dit = dit.Metric(labels=labels, buckets=LATENCY_BUCKETS_S)
        self.step_latency = step.Metric(labels=labels, buckets=LATENCY_BUCKETS_S)
        self.held_blocks = held.Metric(labels=labels)
        self.blocks_run = run.Metric(labels=labels)
        self.loop_cpu = loop_cpu.Metric(labels=labels)
        self.prompt_events = events.Metric(labels=labels)
        self.prompt_cache_hits = hits.Metric(labels=labels)
        self._ended_family = ended
        self._ended = {}  # reason -> its metric, made on its first use
        self._refusals_family = refusals
        self._refusals = {}  # code -> its metric, made on its first use
        self.queue_seconds = queued.Metric(labels=labels, buckets=QUEUE_BUCKETS_S)
        # Made up front: the writer's thread and the group loop's count into them.
        self._snapshots = {event: snapshots.Metric(labels={**labels, "event": event})
                           for event in ("saved", "failed", "resumed")}
        self.drains = drains.Metric(labels=labels)
        self.group = rank == 0
        if self.group:
            self.sessions = {state: sessions.Metric(labels={**labels, "state": state}) for state in SESSION_STATES}
            self.queue_depth = depth.Metric(labels=labels)
            self.free_slots = free.Metric(labels=labels)

    def show_settings(self, sources: Mapping[str, Setting]) -> None:
        """One gauge per resolved setting, its value, labelled with where it came from."""
        family = pb_utils.MetricFamily("lingbot_world_setting", "a resolved engine setting; source: where it came from",
                                       pb_utils.MetricFamily.GAUGE)
        self._families.append(family)
        self._settings = []
        for name, setting in sources.items():
            metric = family.Metric(labels={**self._labels, "setting": name, "source": setting.source})
            metric.set(float(setting.value))
            self._settings.append(metric)

    def loop_block(self, cpu_s: float, blocks: int) -> None:
        """The group loop's report before each run_block (serving.loop_cpu.Report)."""
        self.loop_cpu.increment(cpu_s)
        self.blocks_run.increment(blocks)

    def prompts(self, events: int, hits: int) -> None:
        """The group loop's report after a prompt event (LoopHooks.on_prompts)."""
        self.prompt_events.increment(events)
        self.prompt_cache_hits.increment(hits)

    def session_ended(self, reason: str) -> None:
        """A session this instance owned ended (LoopHooks.on_ended): finished, cancelled, expired, ..."""
        if reason not in self._ended:
            self._ended[reason] = self._ended_family.Metric(labels={**self._labels, "reason": reason})
        self._ended[reason].increment(1)

    def snapshot(self, event: str) -> None:
        """A snapshot of a session this instance owns: saved, failed or resumed (LoopHooks.on_snapshot)."""
        self._snapshots[event].increment(1)

    def refused(self, code: str, user: str = "") -> None:
        """An error response went out with `code` (contract.ERROR_CODES), to key `user` ("": none known)."""
        if code not in self._refusals:
            self._refusals[code] = self._refusals_family.Metric(labels={**self._labels, "code": code})
        self._refusals[code].increment(1)
        if user:
            self._key_metric("refusals", user, code=code).increment(1)

    def key_request(self, user: str) -> None:
        """The door let a request of key `user` in ("": a server without keys, not counted by key)."""
        if user:
            self._key_metric("requests", user).increment(1)

    def key_block(self, user: str) -> None:
        if user:
            self._key_metric("blocks", user).increment(1)

    def _key_metric(self, family: str, user: str, **labels: str):
        index = (family, user, *labels.values())
        if index not in self._key_metrics:
            self._key_metrics[index] = self._by_key[family].Metric(labels={**self._labels, "key": user, **labels})
        return self._key_metrics[index]

    def queue(self, counts: QueueCounts) -> None:
        """The group loop's report after a plan that changed the counts (LoopHooks.on_queue)."""
        for waited in counts.waited_s:
            self.queue_seconds.observe(waited)
        if self.group:
            for state in SESSION_STATES:
                self.sessions[state].set(float(getattr(counts, state)))
            self.queue_depth.set(float(counts.waiting))
            self.free_slots.set(float(counts.free_slots))


class ParkMetrics:
    """The park tier's metrics (docs/serving.md, "Parking"), of the worlds this instance owns; all made up front
    (the intake's thread and the group loop's count into them)."""

    def __init__(self, labels: dict[str, str]) -> None:
        family = pb_utils.MetricFamily
        self._families = [
            family("lingbot_world_parks_total", "this instance's worlds by event: parked (off their slot), unparked "
                   "(back on one), refused (past max_parked), failed (no room, or the copy not written)", family.COUNTER),
            family("lingbot_world_park_seconds", "a park: its decision to its copy durable", family.HISTOGRAM),
            family("lingbot_world_unpark_seconds", "an unpark: the open from its copy on a slot (its wait in the queue: "
                   "lingbot_world_queue_seconds)", family.HISTOGRAM),
            family("lingbot_world_parked_bytes", "bytes of this instance's parked worlds' copies, by tier: memory, "
                   "disk", family.GAUGE),
        ]
        events, park, unpark, held = self._families
        self._events = {event: events.Metric(labels={**labels, "event": event}) for event in PARK_EVENTS}
        self._park = park.Metric(labels=labels, buckets=PARK_BUCKETS_S)
        self._unpark = unpark.Metric(labels=labels, buckets=PARK_BUCKETS_S)
        self._held = {tier: held.Metric(labels={**labels, "tier": tier}) for tier in ("memory", "disk")}
        for gauge in self._held.values():  # Triton keeps a family's values across a reload
            gauge.set(0.0)

    def parks(self, session_id: str, event: str, seconds: float) -> None:
        """The intake's report of a park (serving/parks.Parks' on_park)."""
        self._events[event].increment(1)
        if event == "parked":
            self._park.observe(seconds)

    def unparked(self, session_id: str, line_s: float, open_s: float) -> None:
        """The group loop's report of a world back on its slot (LoopHooks.on_unpark)."""
        self._events["unparked"].increment(1)
        self._unpark.observe(open_s)

    def held(self, memory: int, disk: int) -> None:
        """The bytes this instance's parked worlds hold (serving/parks.Parks' on_bytes)."""
        self._held["memory"].set(float(memory))
        self._held["disk"].set(float(disk))
