"""The documentation a newcomer reads: the API page is the current rendering of the contract and the settings,
every setting has a description, and the README's links lead to files that exist."""
from __future__ import annotations

import re

from backend.api import contract
from backend.api.settings import parameter_fields
from backend.launch.api_doc import API_DOC, field_comments, render
from backend.launch.model_repository import SETTINGS
from backend.launch.paths import REPO_ROOT

def test_committed_api_doc_is_the_current_rendering() -> None:
    assert API_DOC.read_text() == render(), "docs/api.md is stale: run `python -m backend.launch.generated`"


def test_api_doc_has_every_input_output_parameter_and_setting_with_a_description() -> None:
    text = API_DOC.read_text()
    names = [s.name for s in (*contract.INPUTS, *contract.OUTPUTS)] + [p.name for p in contract.REQUEST_PARAMETERS]
    assert all(f"| `{name}` |" in text for name in names)
    for cls in SETTINGS:
        comments = field_comments(cls)
        undocumented = [f.name for f in parameter_fields(cls) if not comments.get(f.name)]
        assert not undocumented, f"{cls.__name__} fields without a comment to render: {undocumented}"


def test_readme_links_resolve_and_it_stays_short() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    links = set(re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme))
    missing = sorted(link for link in links if not link.startswith("http") and not (REPO_ROOT / link).exists())
    assert not missing, missing
    assert not [link for link in links if link.startswith("http")], "the README stands alone: no links outside"
    assert len(readme.splitlines()) <= 180
    for page in (REPO_ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            target = (page.parent / link).resolve()
            assert target.exists(), (page.name, link)


def test_serving_doc_lists_every_metric() -> None:
    source = (REPO_ROOT / "backend" / "adapter" / "metrics.py").read_text()  # imports Triton: read, not imported
    names = re.findall(r'family\("(lingbot_world_\w+)"', source)
    serving = (REPO_ROOT / "docs" / "serving.md").read_text()
    assert names and [n for n in names if f"`{n}`" not in serving] == []


def test_the_player_doc_holds_the_bridge_s_codes_as_they_are() -> None:
    from client.web.codes import render

    assert render() in (REPO_ROOT / "docs" / "player.md").read_text(), \
        "docs/player.md's table of the bridge's codes is stale: paste `python -m client.web.codes` into it"


def test_the_serving_doc_s_status_table_is_the_code_s() -> None:
    """docs/serving.md's table of a session's statuses lists every `Status` once, each with the moves of
    `TRANSITIONS`."""
    from backend.serving.sessions import TRANSITIONS, Status

    section = (REPO_ROOT / "docs" / "serving.md").read_text().split("## A session's lifecycle\n")[1].split("\n## ")[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    table = {row[0].strip("| `"): set(re.findall(r"`([A-Z_]+)`", row[-1])) for row in rows}
    assert len(rows) == len(table) == len(Status)
    assert table == {s.name: {t.name for t in TRANSITIONS[s]} for s in Status}
