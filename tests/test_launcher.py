"""render_config: the runtime config.pbtxt generated from the model template (pure, no server)."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from backend.launcher import parse_param
from backend.model_config import render_config

TEMPLATE = """\
name: "lingbot_world"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
# instance_group [ { count: 7 kind: KIND_GPU } ]  <- a comment, left alone
input [
  { name: "prompt" data_type: TYPE_STRING dims: [ 1 ] }
]
instance_group [
  { count: 1, kind: KIND_CPU }
]
parameters: { key: "checkpoint" value: { string_value: "checkpoints/tiny" } }
parameters: { key: "note" value: { string_value: "has { braces } and \\"quotes\\"" } }
parameters: { key: "odd" value: { string_value: "# not a comment ] }" } }
parameters [
  { key: "dtype", value: { string_value: "float32" } },
  { key: "attention", value: { string_value: "sdpa" } }  # a stray { in a comment
]
"""


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def params_of(text: str) -> dict[str, str]:
    return {key: value.string_value for key, value in parse(text).parameters.items()}


def groups_of(text: str) -> list[tuple[int, str, list[int]]]:
    kinds = model_config_pb2.ModelInstanceGroup.Kind
    return [(g.count, kinds.Name(g.kind), list(g.gpus)) for g in parse(text).instance_group]


def render(
    template: str = TEMPLATE,
    *,
    instances: int = 2,
    kind: str = "KIND_CPU",
    device_ids: list[int] | None = None,
    parameters: dict[str, str] | None = None,
) -> str:
    return render_config(template, instances=instances, kind=kind, device_ids=device_ids, parameters=parameters or {})


def test_cpu_group_replaces_the_template_group() -> None:
    text = render(instances=3)
    assert "instance_group [{ count: 3, kind: KIND_CPU }]" in text
    assert groups_of(text) == [(3, "KIND_CPU", [])]


def test_gpu_gets_one_group_per_device() -> None:
    text = render(instances=2, kind="KIND_GPU", device_ids=[2, 5])
    assert groups_of(text) == [(1, "KIND_GPU", [2]), (1, "KIND_GPU", [5])]


def test_everything_else_is_kept_verbatim() -> None:
    text = render()
    assert "# instance_group [ { count: 7 kind: KIND_GPU } ]  <- a comment, left alone" in text
    assert text.replace("instance_group [{ count: 2, kind: KIND_CPU }]", "") == TEMPLATE.replace(
        "instance_group [\n  { count: 1, kind: KIND_CPU }\n]", ""
    )
    config = parse(text)
    assert (config.name, config.backend, config.model_transaction_policy.decoupled) == ("lingbot_world", "python", True)


def test_named_parameters_are_set_in_both_pbtxt_forms() -> None:
    text = render(parameters={"checkpoint": "/data/ckpt", "attention": "flash"})
    assert params_of(text) == {
        "checkpoint": "/data/ckpt",
        "note": 'has { braces } and "quotes"',
        "odd": "# not a comment ] }",
        "dtype": "float32",
        "attention": "flash",
    }


def test_parameter_values_are_escaped() -> None:
    value = 'C:\\dir "quoted" } ]'
    assert params_of(render(parameters={"note": value}))["note"] == value


def test_unknown_parameter_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"unknown config parameters \[.chekpoint.\].*defines.*checkpoint"):
        render(parameters={"chekpoint": "x"})


def test_every_template_group_is_replaced_by_one() -> None:
    template = TEMPLATE + 'instance_group { count: 4 kind: KIND_GPU gpus: [ 0 ] }\ninstance_group: [{ name: "x" }]\n'
    assert groups_of(render(template, instances=2)) == [(2, "KIND_CPU", [])]


def test_template_without_group_gets_one_appended() -> None:
    template = 'name: "m"\nbackend: "python"'
    assert (
        render(template, instances=1) == 'name: "m"\nbackend: "python"\ninstance_group [{ count: 1, kind: KIND_CPU }]\n'
    )


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
    with pytest.raises(ValueError, match=message):
        render(**overrides)


def test_unbalanced_template_is_an_error() -> None:
    with pytest.raises(ValueError, match="unbalanced bracket"):
        render('name: "m"\ninstance_group [ { count: 1 }\n')


def test_param_flag_splits_at_the_first_equals() -> None:
    assert parse_param("prompt_suffix=a=b") == ("prompt_suffix", "a=b")
