#!/usr/bin/env bash
# Create .venv (Python 3.11) with the project, the CPU tritonserver wheel and test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# Pin the CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/python -m pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install --quiet -e '.[server,test,mpi]'
