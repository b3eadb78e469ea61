#!/usr/bin/env bash
# Issue 12's device check in one run (about 5 minutes on an H200): the 14B geometry with random bf16 weights
# at SP1, eager then compiled, then the torch profiler on one full-window block. Output goes to $OUT.
#
#   here, once:   bash bench/gpu_wheels.sh
#   device run:   command "bash bench/run_on_gpu.sh", carry [".whl"], timeout_s 540
#   CPU dry run:  PYTHON=.venv/bin/python bash bench/run_on_gpu.sh --dry-run   (tiny preset, writes build/gpu_out)
#
# Extra arguments go to `python -m bench.gpu --random-weights`. The torch is the machine's own (the lent device has
# no package index, and a CUDA torch is too large to carry); environment.txt names it beside pyproject.toml's pin.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PINNED_TORCH=$(bash scripts/torch_version.sh)
OUT=${OUT:-build/gpu_out}
mkdir -p "$OUT"
if ! "$PYTHON" -c "import diffusers" 2>/dev/null; then
  [ -d .whl ] || { echo "error: diffusers is not installed and .whl/ is absent: run bash bench/gpu_wheels.sh" >&2; exit 1; }
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PYTHON" -c "import sys, torch, diffusers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'(pinned $PINNED_TORCH)', 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__)"
  torch=$("$PYTHON" -c "import torch; print(torch.__version__.split('+')[0])")
  [ "$torch" = "$PINNED_TORCH" ] || echo "note: these numbers are torch $torch's, not the pinned $PINNED_TORCH's"
} 2>&1 | tee "$OUT/environment.txt"
"$PYTHON" -m bench.gpu --random-weights --modes eager compiled --profile "$@" 2>&1 | tee "$OUT/random_weights_sp1.txt"
