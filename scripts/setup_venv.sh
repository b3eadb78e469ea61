#!/usr/bin/env bash
# Create .venv (Python 3.11) with the project, the CPU tritonserver wheel and test tools. Idempotent: pip runs
# only when pyproject.toml, this script or TORCH_VERSION changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH=${TORCH_VERSION:-2.13.0}
STAMP=.venv/.installed
WANT="$(cat pyproject.toml scripts/setup_venv.sh | sha256sum | cut -d' ' -f1) torch==$TORCH"
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
echo "setting up .venv: CPU torch $TORCH, this project, the tritonserver wheel (a few minutes the first time: 2 min 40 s on a fresh machine)..." >&2
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# Pin the CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet "torch==$TORCH"
.venv/bin/python -m pip install --quiet -e '.[server,web,test,mpi]'
echo "$WANT" >"$STAMP"
echo ".venv ready" >&2
