"""Where this instance sits in the SP group: its global rank and the number of ranks.

Each server (one per host under mpirun) runs the same number of instances; an instance's global rank is
host_rank x local instances + its local index, so the instances of server 0 hold ranks 0..n-1.
"""
from __future__ import annotations

import re

from ..api.errors import ConfigError


def instance_rank(args: dict, model_config: dict, host_rank: int = 0, host_count: int = 1) -> tuple[int, int]:
    """(global rank, the number of ranks) of this instance: its local position among this server's instances
    (by GPU id for KIND_GPU, by instance index for KIND_CPU), offset by the server's `host_rank`."""
    index, local = local_rank(args, model_config)
    return host_rank * local + index, host_count * local


def local_rank(args: dict, model_config: dict) -> tuple[int, int]:
    """(index, count) of this instance among this server's instances of the model."""
    groups = model_config.get("instance_group", [])
    if args["model_instance_kind"] == "GPU":
        devices = sorted(int(d) for g in groups for d in g.get("gpus", []) for _ in range(int(g.get("count", 1))))
        device = int(args["model_instance_device_id"])
        if len(set(devices)) != len(devices):
            raise ConfigError(f"instance_group must place one instance per GPU; got GPUs {devices}")
        return devices.index(device), len(devices)
    # Triton names CPU instances "<group name>_<index>"; a group's name defaults to "<model>_<group index>".
    name = args["model_instance_name"]
    offset = 0
    for i, group in enumerate(groups):
        group_name = group.get("name") or f"{args['model_name']}_{i}"
        match = re.fullmatch(re.escape(group_name) + r"_(\d+)", name)
        if match:
            return offset + int(match.group(1)), sum(int(g.get("count", 1)) for g in groups)
        offset += int(group.get("count", 1))
    raise ConfigError(f"cannot place instance {name!r} in instance_group {groups}")
