"""The model repository of a run: config.pbtxt rendered from the template with instances and parameters."""
from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .paths import DEFAULT_REPOSITORY_DIR, TEMPLATE_DIR

KINDS = ("KIND_CPU", "KIND_GPU")


# A pbtxt field holding a message or a list: `name {`, `name: {`, `name [` or `name: [`.
_FIELD_HEAD = re.compile(r"([A-Za-z_]\w*)\s*:?\s*([\[{])")
_KEY = re.compile(r"\bkey\s*:\s*\"((?:[^\"\\]|\\.)*)\"")
_STRING_VALUE = re.compile(r"\bstring_value\s*:\s*(\"(?:[^\"\\]|\\.)*\")")


@dataclass(frozen=True)
class _Field:
    """A top-level message or list field of a pbtxt text: text[start:end], brackets included."""

    name: str
    start: int
    end: int
    is_list: bool


def _code_indices(text: str, start: int = 0, end: int | None = None) -> Iterator[int]:
    """Indices of text[start:end] outside string literals and `#` comments."""
    i, end = start, len(text) if end is None else end
    while i < end:
        ch = text[i]
        if ch in "\"'":
            quote, i = ch, i + 1
            while i < len(text) and text[i] != quote:
                i += 2 if text[i] == "\\" else 1
            if i >= len(text):
                raise ValueError("unterminated string in config.pbtxt")
        elif ch == "#":
            newline = text.find("\n", i)
            i = len(text) if newline == -1 else newline
            continue
        else:
            yield i
        i += 1


def _matching_close(text: str, open_at: int) -> int:
    """Index just past the bracket that closes text[open_at]."""
    depth = 0
    for i in _code_indices(text, open_at):
        if text[i] in "[{":
            depth += 1
        elif text[i] in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced bracket at offset {open_at} of config.pbtxt")


def _top_level_fields(text: str) -> list[_Field]:
    fields: list[_Field] = []
    for i in _code_indices(text):
        if fields and i < fields[-1].end:
            continue  # inside the previous field
        if i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_"):
            continue  # not the start of a name
        if match := _FIELD_HEAD.match(text, i):
            fields.append(_Field(match.group(1), i, _matching_close(text, match.start(2)), match.group(2) == "["))
    return fields


def _messages(text: str, field: _Field) -> list[tuple[int, int]]:
    """Spans of the message bodies of a field: one for `name {..}`, each element of `name [{..}, ..]`."""
    open_at = next(i for i in _code_indices(text, field.start) if text[i] in "[{")
    if not field.is_list:
        return [(open_at + 1, field.end - 1)]
    spans: list[tuple[int, int]] = []
    for i in _code_indices(text, open_at + 1, field.end - 1):
        if text[i] == "{" and not (spans and i < spans[-1][1]):
            spans.append((i + 1, _matching_close(text, i) - 1))
    return spans


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_instance_group(*, instances: int, kind: str, device_ids: list[int] | None) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    if kind == "KIND_CPU":
        if device_ids is not None:
            raise ValueError("device_ids apply to KIND_GPU only")
        return f"instance_group [{{ count: {instances}, kind: KIND_CPU }}]"
    if device_ids is None or len(device_ids) != instances:
        raise ValueError(f"KIND_GPU takes one device id per instance: {instances} instances, device_ids={device_ids}")
    groups = ",\n".join(f"  {{ count: 1, kind: KIND_GPU, gpus: [{i}] }}" for i in device_ids)
    return f"instance_group [\n{groups}\n]"


def _parameter_edits(text: str, fields: list[_Field], parameters: dict[str, str]) -> list[tuple[int, int, str]]:
    """(start, end, replacement) edits setting the string_value of each named `parameters` entry."""
    edits, found = [], set()
    for field in (f for f in fields if f.name == "parameters"):
        for start, end in _messages(text, field):
            key, value = _KEY.search(text, start, end), _STRING_VALUE.search(text, start, end)
            if key is None or value is None:
                raise ValueError(f"parameters entry without key/string_value: {text[start:end].strip()!r}")
            found.add(key.group(1))
            if key.group(1) in parameters:
                edits.append((value.start(1), value.end(1), _quote(parameters[key.group(1)])))
    if unknown := sorted(set(parameters) - found):
        raise ValueError(f"unknown config parameters {unknown}; the template defines {sorted(found)}")
    return edits


def render_config(
    template_text: str, *, instances: int, kind: str, device_ids: list[int] | None, parameters: dict[str, str]
) -> str:
    """The template config.pbtxt with its instance_group replaced and named parameters' values set.

    Every `parameters` key must exist in the template (a typo would otherwise be silently ignored).
    """
    group = render_instance_group(instances=instances, kind=kind, device_ids=device_ids)
    fields = _top_level_fields(template_text)
    edits = _parameter_edits(template_text, fields, parameters)
    groups = [f for f in fields if f.name == "instance_group"]
    if not groups:
        return template_text.rstrip("\n") + "\n" + group + "\n"
    edits.append((groups[0].start, groups[0].end, group))
    edits.extend((f.start, f.end, "") for f in groups[1:])
    text = template_text
    for start, end, replacement in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    return text


def write_model_repository(
    out_dir: Path = DEFAULT_REPOSITORY_DIR,
    *,
    instances: int,
    kind: str,
    device_ids: list[int] | None = None,
    parameters: dict[str, str] | None = None,
    template_dir: Path = TEMPLATE_DIR,
) -> Path:
    """Write `out_dir/<model>/{config.pbtxt,1/model.py}` from the template; returns `out_dir`."""
    template = template_dir / "config.pbtxt"
    if not template.is_file():
        raise FileNotFoundError(f"model template {template} is missing")
    config = render_config(
        template.read_text(), instances=instances, kind=kind, device_ids=device_ids, parameters=parameters or {}
    )
    model_dir = out_dir / template_dir.name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(config)
    shutil.copy2(template_dir / "1" / "model.py", model_dir / "1" / "model.py")
    return out_dir
