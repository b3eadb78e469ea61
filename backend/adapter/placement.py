"""Where this instance sits in the SP group: its rank and the world size, from Triton's instance arguments."""
from __future__ import annotations

import os
import re

from ..api.errors import ConfigError


def instance_rank(args: dict, model_config: dict) -> tuple[int, int]:
    """(rank, world size) of this instance in the SP group.

    Under mpirun (one tritonserver per rank, one instance each) MPI's rank and size; otherwise the
    position among this model's instances: by GPU id for KIND_GPU, by instance index for KIND_CPU.
    """
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
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
