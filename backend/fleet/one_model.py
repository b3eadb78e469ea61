"""One model everywhere: every group behind one balancer serves the same checkpoint and settings, so a session that
is retried or replayed on another group gets the same latents. Each group describes itself in its model config
(its parameters and, from the launcher, api/description); the fleet compares them when it starts and refuses a
difference, naming the setting."""
from __future__ import annotations

from collections.abc import Mapping

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ..api.contract import MODEL_NAME
from ..api.description import PREFIX
from ..api.provenance import parse_settings

# A group's own placement: where its ranks meet and how many there are (SP1, SP2 and SP4 give the same bits), and
# where it parks worlds in host memory (each group's own folder).
PER_GROUP = ("sp_degree", "host_rank", "host_count", "rendezvous_host", "rendezvous_port", "park_memory_dir")
SETTINGS_USED = PREFIX + "settings_used"


def read_parameters(grpc_url: str, model: str = MODEL_NAME) -> dict[str, str]:
    """The model config parameters a group's server reports."""
    try:
        with grpcclient.InferenceServerClient(grpc_url) as client:
            config = client.get_model_config(model, as_json=True, client_timeout=10)["config"]
    except InferenceServerException as exc:
        raise RuntimeError(f"reading {model!r}'s config from {grpc_url} failed: {exc.message()}") from exc
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def world_of(parameters: Mapping[str, str], where: str) -> dict[str, str]:
    """What must be equal on every group: every parameter but its placement, the settings the latents depend on
    one by one (`described_settings_used.NAME`, as resolved from the checkpoint) and the rest of the description."""
    if SETTINGS_USED not in parameters:
        raise ValueError(f"{where} does not describe itself ({SETTINGS_USED} missing): start it with the launcher")
    used = parse_settings(parameters[SETTINGS_USED], SETTINGS_USED)
    world = {k: v for k, v in parameters.items() if k not in PER_GROUP and k != SETTINGS_USED}
    return world | {f"{SETTINGS_USED}.{k}": v for k, v in used.items()}


def check_one_model(groups: Mapping[str, Mapping[str, str]]) -> None:
    """`groups`: each group's name (where it is) -> its model config parameters. ValueError names every setting in
    which a group differs from the first."""
    (first, reference), *others = ((name, world_of(p, name)) for name, p in groups.items())
    problems = []
    for name, world in others:
        for key in sorted(reference.keys() | world.keys()):
            if reference.get(key) != world.get(key):
                problems.append(f"{key}: {world.get(key)!r} on {name}, {reference.get(key)!r} on {first}")
    if problems:
        raise ValueError("the groups do not serve one model (a retry or replay on another group would differ): "
                         + "; ".join(problems) + ". Start every group with the same checkpoint and --param values")
