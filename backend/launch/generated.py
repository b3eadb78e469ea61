"""Every file derived from the wire contract and the settings, written again in one command:

    python -m backend.launch.generated

model_repository/lingbot_world/config.pbtxt (the default rendering: inputs, outputs, parameters) and
docs/api.md. Tests fail while either is stale."""
from __future__ import annotations

from pathlib import Path

from . import api_doc
from .model_repository import render_config
from .paths import TEMPLATE_DIR

CONFIG = TEMPLATE_DIR / "config.pbtxt"


def rendered() -> dict[Path, str]:
    """Each generated file and what it must hold."""
    return {CONFIG: render_config(instances=1, kind="KIND_CPU"), api_doc.API_DOC: api_doc.render()}


def main() -> int:
    for path, text in rendered().items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
