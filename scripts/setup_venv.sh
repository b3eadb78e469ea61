#!/usr/bin/env bash
# Create .venv (Python 3.11) with the CPU build of the torch pyproject.toml pins, the project, the CPU tritonserver
# wheel and test tools. Idempotent: pip runs only when pyproject.toml or this script changed since the last
# successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=$(bash scripts/torch_version.sh)
STAMP=.venv/.installed
WANT="$(cat pyproject.toml scripts/setup_venv.sh | sha256sum | cut -d' ' -f1) torch==$TORCH+cpu"
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
echo "setting up .venv: CPU torch $TORCH, this project, the tritonserver wheel (a few minutes the first time: 2 min 40 s on a fresh machine)..." >&2
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# The CPU build first, named by its local label: a bare torch==X from PyPI is the multi-GB CUDA build. The project's
# own torch==X is then already met.
if ! .venv/bin/python -m pip install --quiet "torch==$TORCH+cpu"; then
  echo "error: pip finds no CPU build of torch $TORCH (torch==$TORCH+cpu) here: give pip PyTorch's CPU wheel index" \
    "(PIP_EXTRA_INDEX_URL) or a folder holding that wheel (PIP_FIND_LINKS)" >&2
  exit 1
fi
.venv/bin/python -m pip install --quiet -e '.[server,web,test,mpi,books]'
echo "$WANT" >"$STAMP"
echo ".venv ready" >&2
