"""The rendered config.pbtxt: wire contract, settings parameters and placement (pure, no server)."""
from __future__ import annotations

import dataclasses
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from backend.api import contract
from backend.api.description import split_description
from backend.api.errors import ConfigError
from backend.api.settings import format_value, parameter_fields
from backend.engine.settings import EngineSettings
from backend.engine.validation import checked_spec
from backend.launch.launcher import (Termination, build_parser, default_park_dir, drains_on_sigterm, main, parse_param,
                                     render, tls_of)
from backend.launch.generated import rendered
from backend.launch.model_repository import render_config
from backend.launch.mpi import own_address
from backend.launch.server import CPU_ONLY_ARGS, TritonServer
from backend.parallel.ports import port_in_use
from backend.serving.settings import ServingSettings, split_parameters
from backend.serving.description import check_description


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def params_of(text: str) -> dict[str, str]:
    return {key: value.string_value for key, value in parse(text).parameters.items()}


def groups_of(text: str) -> list[tuple[int, str, list[int]]]:
    kinds = model_config_pb2.ModelInstanceGroup.Kind
    return [(g.count, kinds.Name(g.kind), list(g.gpus)) for g in parse(text).instance_group]


def test_inputs_and_outputs_are_the_contract() -> None:
    config = parse(render_config(instances=1, kind="KIND_CPU"))
    dtypes = model_config_pb2.DataType
    rendered = [(t.name, dtypes.Name(t.data_type), list(t.dims), t.optional) for t in config.input]
    expected = [(s.name, "TYPE_" + ("STRING" if s.triton_dtype == "BYTES" else s.triton_dtype), list(s.dims), s.optional)
                for s in contract.INPUTS]
    assert rendered == expected
    assert [(t.name, list(t.dims)) for t in config.output] == [(s.name, list(s.dims)) for s in contract.OUTPUTS]
    assert (config.name, config.backend, config.model_transaction_policy.decoupled) == (contract.MODEL_NAME, "python", True)


def test_committed_config_is_the_default_rendering() -> None:
    for path, text in rendered().items():  # config.pbtxt and docs/api.md
        assert path.read_text() == text, f"{path} is stale: run `python -m backend.launch.generated`"


def test_every_setting_is_a_parameter_with_its_default() -> None:
    params = params_of(render_config(instances=1, kind="KIND_CPU"))
    fields = [f for cls in (EngineSettings, ServingSettings) for f in parameter_fields(cls)]
    assert sorted(params) == sorted(f.name for f in fields)
    for f in fields:
        if f.default is not dataclasses.MISSING:
            assert params[f.name] == format_value(f.default), f.name
    assert "device" not in params  # set by each instance, not by config


def _other_value(f: dataclasses.Field) -> str:
    default = f.default
    if f.type == "bool":
        return format_value(not default)
    if f.type == "int":
        return str(default + 3)
    if f.type == "float":
        return str(default + 0.5)
    return f"{f.name}-value"


@pytest.mark.parametrize("cls", [EngineSettings, ServingSettings])
def test_each_field_round_trips_through_param_flags(tmp_path: Path, cls: type) -> None:
    for f in parameter_fields(cls):
        if f.name == "sp_degree":
            continue  # the launcher sets it from --sp
        value = _other_value(f) if f.default is not dataclasses.MISSING else "/data/ckpt"
        hosts = ["--param", "host_count=4"] if f.name == "host_rank" else []  # host_rank=3 needs 4 hosts
        instances = "4" if f.name == "tp_degree" else "2"  # tp_degree=4 needs 4 instances
        args = build_parser().parse_args(
            ["--kind", "cpu", "--sp", instances, "--param", f"{f.name}={value}", *hosts, "--repository-out",
             str(tmp_path)]
        )
        repository, _, _ = render(args)
        text = (repository / contract.MODEL_NAME / "config.pbtxt").read_text()
        engine, serving = split_parameters(params_of(text))
        settings = engine if cls is EngineSettings else serving
        assert format_value(getattr(settings, f.name)) == value, f.name
        # --sp instances on each server, each one rank of tp x sp
        assert engine.sp_degree * engine.tp_degree == int(instances) * serving.host_count


def test_tp_degree_divides_the_instances_into_sp_groups(tmp_path: Path) -> None:
    def sp_degree(*flags: str) -> int:
        args = build_parser().parse_args(["--kind", "cpu", *flags, "--repository-out", str(tmp_path)])
        repository, _, _ = render(args)
        return split_parameters(params_of((repository / contract.MODEL_NAME / "config.pbtxt").read_text()))[0].sp_degree

    assert sp_degree("--sp", "4", "--param", "tp_degree=2") == 2
    assert sp_degree("--sp", "4", "--param", "tp_degree=2", "--param", "host_count=2") == 4
    with pytest.raises(ValueError, match=r"tp_degree=4 does not divide the 2 instances \(--sp 2 x 1\)"):
        sp_degree("--sp", "2", "--param", "tp_degree=4")


def test_host_rank_outside_host_count_is_an_error_naming_both(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["--kind", "cpu", "--param", "host_rank=2", "--param", "host_count=2", "--repository-out", str(tmp_path)]
    )
    with pytest.raises(ValueError, match=r"host_rank=2 must be in \[0, host_count=2\)"):
        render(args)


def test_cpu_and_gpu_groups() -> None:
    assert groups_of(render_config(instances=3, kind="KIND_CPU")) == [(3, "KIND_CPU", [])]
    text = render_config(instances=2, kind="KIND_GPU", device_ids=[2, 5])
    assert groups_of(text) == [(1, "KIND_GPU", [2]), (1, "KIND_GPU", [5])]


def test_parameter_values_are_escaped() -> None:
    value = 'C:\\dir "quoted" } ] # no comment'
    assert params_of(render_config(instances=1, kind="KIND_CPU", parameters={"checkpoint": value}))["checkpoint"] == value


def test_unknown_parameter_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"unknown config parameters \[.chekpoint.\].*settable.*checkpoint"):
        render_config(instances=1, kind="KIND_CPU", parameters={"chekpoint": "x"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kind": "cpu"}, "kind must be one of"),
        ({"instances": 0}, "instances must be >= 1"),
        ({"device_ids": [0, 1]}, "device_ids apply to KIND_GPU only"),
        ({"kind": "KIND_GPU", "device_ids": None}, "one device id per instance"),
        ({"kind": "KIND_GPU", "device_ids": [0]}, "one device id per instance"),
    ],
)
def test_invalid_placement_is_rejected(overrides: dict[str, Any], message: str) -> None:
    kwargs: dict[str, Any] = {"instances": 2, "kind": "KIND_CPU", "device_ids": None, **overrides}
    with pytest.raises(ValueError, match=message):
        render_config(**kwargs)


def test_param_flag_splits_at_the_first_equals() -> None:
    assert parse_param("prompt_suffix=a=b") == ("prompt_suffix", "a=b")


def test_rendezvous_address_follows_gloo_socket_ifname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert own_address(hosts=2) == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0,lo")
    with pytest.raises(ValueError, match="GLOO_SOCKET_IFNAME=nosuch0: interface has no IPv4 address"):
        own_address(hosts=2)


def test_one_host_picks_a_free_rendezvous_port(tmp_path: Path) -> None:
    ports = set()
    for name in ("a", "b"):
        args = build_parser().parse_args(["--kind", "cpu", "--sp", "2", "--repository-out", str(tmp_path / name)])
        _, serving = split_parameters(params_of((render(args)[0] / contract.MODEL_NAME / "config.pbtxt").read_text()))
        assert not port_in_use(serving.rendezvous_port)
        ports.add(serving.rendezvous_port)
    assert ServingSettings.rendezvous_port not in ports  # not the fixed default a second server would share


def test_busy_rendezvous_port_fails_at_once_naming_port_and_parameter(tmp_path: Path, capsys) -> None:
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        started = time.monotonic()
        rc = main(["--kind", "cpu", "--sp", "2", "--param", f"rendezvous_port={port}",
                   "--repository-out", str(tmp_path)])
    assert rc == 1 and time.monotonic() - started < 10
    assert f"rendezvous_port={port} is in use on this host" in capsys.readouterr().err


def test_cpu_start_lines_are_no_error_excerpt(tmp_path: Path) -> None:
    log = tmp_path / "tritonserver.log"
    log.write_text('I1203 13:52:58.385043 1 cuda_memory_manager.cc:117] "CUDA memory pool disabled"\n'
                   'E1203 13:52:58.385104 1 server.cc:241] "CudaDriverHelper has not been initialized."\n'
                   'E1203 13:53:00.000000 1 model_lifecycle.cc:1] "failed to load lingbot_world: boom"\n')
    server = TritonServer(tmp_path, log_path=log, extra_args=CPU_ONLY_ARGS)
    assert server.log_excerpt() == 'E1203 13:53:00.000000 1 model_lifecycle.cc:1] "failed to load lingbot_world: boom"'
    assert "--pinned-memory-pool-byte-size=0" in server.command() and "--allow-gpu-metrics=false" in server.command()


def test_the_launchers_tls_flags_reach_tritonserver_and_a_client_ca_makes_it_mutual(tmp_path: Path) -> None:
    cert, key, ca = (tmp_path / name for name in ("server.pem", "server.key", "clients-ca.pem"))
    for path in (cert, key, ca):
        path.write_text("PEM")

    def command(*flags: str) -> list[str]:  # what the launcher's flags make tritonserver run
        return TritonServer(tmp_path, tls=tls_of(build_parser().parse_args(["--kind", "cpu", *flags]))).command()

    tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
    served = ["--grpc-use-ssl=true", f"--grpc-server-cert={cert.resolve()}", f"--grpc-server-key={key.resolve()}"]
    mutual = ["--grpc-use-ssl-mutual=true", f"--grpc-root-cert={ca.resolve()}"]
    assert set(served + mutual) <= set(command(*tls, "--tls-client-ca", str(ca)))
    one_way = command(*tls)
    assert set(served) <= set(one_way) and not set(mutual) & set(one_way)
    assert not [arg for arg in command() if "ssl" in arg]
    with pytest.raises(ValueError, match="--tls-client-ca needs --tls-cert and --tls-key"):  # refused, not dropped
        command("--tls-client-ca", str(ca))


def test_the_launcher_describes_the_server_and_an_instance_refuses_a_false_description(tmp_path: Path,
                                                                                     tiny_checkpoint: str) -> None:
    """What a client reads of the server (its block size, limits, layout) is what it resolved from the checkpoint;
    a description that differs (a hand-edited config.pbtxt) is refused at load, naming the entry."""
    args = build_parser().parse_args(["--kind", "cpu", "--sp", "2", "--param", f"checkpoint={tiny_checkpoint}",
                                      "--param", "max_sessions=7", "--repository-out", str(tmp_path)])
    repository, _, _ = render(args)
    description, rest = split_description(params_of((repository / contract.MODEL_NAME / "config.pbtxt").read_text()))
    engine, serving = split_parameters(rest)
    assert (description.layout, description.block_frames, description.max_sessions) == ("diffusers", 3, 7)
    assert description.settings_used.startswith("block_frames=3;")
    spec = checked_spec(engine, 2)
    check_description(description, spec, serving)
    with pytest.raises(ConfigError, match=r"described != resolved\): block_frames: 4 != 3; rewrite it with the "
                                          r"launcher"):
        check_description(dataclasses.replace(description, block_frames=4), spec, serving)


def test_sigterm_drains_where_the_server_keeps_snapshots_and_is_its_whole_group() -> None:
    def drains(*flags: str) -> bool:
        return drains_on_sigterm(build_parser().parse_args(["--kind", "cpu", *flags]))

    assert drains() and drains("--param", "snapshot_dir=/srv/worlds")  # the launcher's default store, or one given
    assert not drains("--param", "snapshot_dir=")  # no store: nothing to save a world into, SIGTERM stops at once
    assert not drains("--param", "host_count=2") and not drains("--mpi")  # a host sees its own streams only


def test_a_group_on_one_host_parks_in_its_own_folder_in_host_memory_unless_told() -> None:
    def park_dir(*flags: str) -> Path | None:
        return default_park_dir(build_parser().parse_args(["--kind", "cpu", *flags]))

    mine, theirs = park_dir("--repository-out", "/srv/g0/repo"), park_dir("--repository-out", "/srv/g1/repo")
    assert mine.parent == Path("/dev/shm") and mine.name.startswith("lingbot-park-") and mine != theirs
    assert mine == park_dir("--repository-out", "/srv/g0/repo")  # the same folder across the healer's reloads
    assert park_dir("--param", "park_memory_dir=/mnt/ram") is None and park_dir("--mpi") is None
    assert park_dir("--render-only") is None


def test_a_second_sigterm_cuts_the_drain_short_and_a_third_leaves_the_stop_alone() -> None:
    termination = Termination()
    with pytest.raises(SystemExit) as first:
        termination()
    assert first.value.code == 143 and termination.asked
    termination.draining = True  # as drain() sets it
    with pytest.raises(SystemExit):
        termination()
    assert not termination.draining
    termination()  # the stop is under way: ignored
