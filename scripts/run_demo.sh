#!/usr/bin/env bash
# Start tritonserver on the tiny random checkpoint (SP=${SP:-1} CPU instances) and stream one session
# with the client: per-block progress, time to first block, an MP4 and a contact sheet under out/.
# The checkpoint's weights are random: the video is noise. Ports: GRPC_PORT (8001), HTTP_PORT (8000),
# METRICS_PORT (8002).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
PY=.venv/bin/python
SP=${SP:-1}
GRPC_PORT=${GRPC_PORT:-8001}
HTTP_PORT=${HTTP_PORT:-8000}
METRICS_PORT=${METRICS_PORT:-8002}
WAIT_S=${WAIT_S:-300}
CKPT=build/checkpoints/tiny
for name in GRPC_PORT HTTP_PORT METRICS_PORT; do
  if $PY -c "import sys; from backend.parallel.ports import port_in_use; sys.exit(not port_in_use(${!name}))"; then
    echo "port ${!name} ($name) is in use on this host; choose another, e.g. $name=$((${!name} + 100)) bash $0" >&2
    exit 1
  fi
done
echo "writing the tiny random checkpoint to $CKPT (once; random weights, so the demo draws noise)..."
$PY -m backend.model.tiny_checkpoint "$CKPT" --if-stale >/dev/null
mkdir -p build out
echo "starting tritonserver with $SP CPU instance(s) (log: build/launcher.out, build/tritonserver.log)..."
$PY -m backend.launch --sp "$SP" --kind cpu --grpc-port "$GRPC_PORT" --http-port "$HTTP_PORT" \
  --metrics-port "$METRICS_PORT" --param checkpoint="$CKPT" --param dtype=float32 \
  --param default_height=128 --param default_width=128 --wait --wait-timeout "$WAIT_S" >build/launcher.out 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
READY_URL="http://127.0.0.1:$HTTP_PORT/v2/models/lingbot_world/ready"
ready() { $PY -c "import sys, urllib.request as u; sys.exit(u.urlopen('$READY_URL', timeout=5).status != 200)" 2>/dev/null; }
deadline=$((SECONDS + WAIT_S))
until ready; do
  if ! kill -0 $SERVER 2>/dev/null; then
    rc=0; wait $SERVER || rc=$?
    echo "the server failed to start (launcher exit status $rc):" >&2
    cat build/launcher.out >&2
    exit 1
  fi
  if [ $SECONDS -ge $deadline ]; then
    echo "the server was not ready after ${WAIT_S} s (WAIT_S); see build/launcher.out and build/tritonserver.log" >&2
    exit 1
  fi
  sleep 1
done
echo "server ready ($READY_URL); streaming one session (57 frames, 128x128)..."
$PY -m client --url "localhost:$GRPC_PORT" --prompt "a castle in the forest at sunset" --camera forward \
  --num-frames 57 --height 128 --width 128 --seed 42 \
  --out out/demo.mp4 --contact-sheet out/demo_sheet.png --timeout 300
