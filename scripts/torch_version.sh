#!/usr/bin/env bash
# Print the torch version pyproject.toml pins ("torch==X.Y.Z" in its dependencies), the one torch of every path:
# the venv and CI install its CPU build (scripts/setup_venv.sh), the compose images its CUDA build, and the GPU
# benchmark names it beside the torch it ran on (bench/run_on_gpu.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^ *"torch==\([0-9][0-9.]*\)",\{0,1\}$/\1/p' pyproject.toml)
if [ -z "$version" ] || [ "$(echo "$version" | wc -l)" -ne 1 ]; then
  echo "error: pyproject.toml must pin torch once in its dependencies, as \"torch==X.Y.Z\"" >&2
  exit 1
fi
echo "$version"
