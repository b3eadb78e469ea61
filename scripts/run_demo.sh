#!/usr/bin/env bash
# Start tritonserver on the tiny random checkpoint (SP=${SP:-1} CPU instances) and stream one session
# with the client: per-block progress, time to first block, an MP4 and a contact sheet under out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
PY=.venv/bin/python
SP=${SP:-1}
CKPT=build/checkpoints/tiny
echo "writing the tiny random checkpoint to $CKPT (once)..."
$PY -m backend.model.tiny_checkpoint "$CKPT" --if-stale >/dev/null
mkdir -p build out
echo "starting tritonserver with $SP CPU instance(s) (log: build/launcher.out, build/tritonserver.log)..."
$PY -m backend.launch --sp "$SP" --kind cpu --grpc-port 8001 --http-port 8000 --metrics-port 8002 \
  --param checkpoint="$CKPT" --param dtype=float32 --param default_height=128 --param default_width=128 \
  --wait --wait-timeout 300 >build/launcher.out 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  grep -q "ready" build/launcher.out && break
  kill -0 $SERVER 2>/dev/null || { cat build/launcher.out; exit 1; }
  sleep 0.5
done
grep -q "ready" build/launcher.out || { echo "server not ready; see build/tritonserver.log" >&2; exit 1; }
echo "server ready; streaming one session (57 frames, 128x128)..."
$PY -m client --url localhost:8001 --prompt "a castle in the forest at sunset" --camera forward \
  --num-frames 57 --height 128 --width 128 --seed 42 \
  --out out/demo.mp4 --contact-sheet out/demo_sheet.png --timeout 300
