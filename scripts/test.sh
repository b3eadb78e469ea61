#!/usr/bin/env bash
# Set up the venv and run the test suite but its slow tier (--slow adds it: docs/testing.md): the engine, real
# tritonservers over gRPC, the client, the browser player, the fleet behind HAProxy on its books in Redis. The
# Debian packages some tests need (openmpi-bin, chromium, iproute2, haproxy, redis-server, dnsmasq, coturn,
# iptables) are installed when missing (as root with apt-get), else the run stops naming them; then a test skipped
# for a missing tool fails (LINGBOT_REQUIRE_TOOLS=1). LINGBOT_REQUIRE_TOOLS=0 bash scripts/test.sh tests/test_x.py lets them skip.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh || exit 1
export LINGBOT_REQUIRE_TOOLS=${LINGBOT_REQUIRE_TOOLS:-1}
if [ "$LINGBOT_REQUIRE_TOOLS" = 1 ]; then
  missing=()
  command -v mpirun >/dev/null || missing+=(openmpi-bin)
  [ -x "${CHROMIUM:-/usr/bin/chromium}" ] || missing+=(chromium)
  command -v ip >/dev/null || missing+=(iproute2)
  [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
  command -v redis-server >/dev/null || missing+=(redis-server)
  [ -x /usr/sbin/dnsmasq ] || missing+=(dnsmasq)
  [ -x /usr/bin/turnserver ] || missing+=(coturn)
  command -v iptables >/dev/null || missing+=(iptables)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
      echo "installing the Debian packages the tests need: ${missing[*]}..." >&2
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } || exit 1
    else
      echo "the tests need these Debian packages: ${missing[*]} (sudo apt-get install ${missing[*]}); or run" \
        "LINGBOT_REQUIRE_TOOLS=0 bash scripts/test.sh to let their tests skip" >&2
      exit 1
    fi
  fi
fi
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing the run" >&2
fi
exit "$rc"
