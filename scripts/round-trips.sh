#!/usr/bin/env bash
# The steps of a small transfer timed alone (`te probe`), then te's own 4 KiB round
# trips between two processes of this host in the same sitting: through the same-host
# channel, and over the socket as between two hosts (`local_ipc = false`, device
# memory staged), so each round trip reads against its steps (docs/benchmarks.md,
# "What the steps of a small transfer cost").
#
# Usage: scripts/round-trips.sh TE MEM [CONFIG]   (MEM: host, fakedev:0, cuda:0, …;
#        CONFIG: a te configuration both processes use, e.g. for [runtimes.fakedev])
set -euo pipefail
cd "$(dirname "$0")/.."
te=$1
mem=$2
cfg=${3:-}
source scripts/serve.sh
with=()
[ -n "$cfg" ] && with=(--config "$cfg")
"$te" probe --mem "$mem" "${with[@]}"
printf '[backends.tcp]\nlocal_ipc = false\n' >"$work/socket.toml"
[ -n "$cfg" ] && cat "$cfg" >>"$work/socket.toml"
echo "te bench --target, 4 KiB × 1, p50 / p99 µs:"
for path in channel socket; do
  c=("${with[@]}")
  [ $path = socket ] && c=(--config "$work/socket.toml")
  serve --buffer-size 64MiB "${c[@]}"
  for op in write read; do
    "$te" bench --backend tcp "${c[@]}" --target "$target" --mem "$mem" --op $op \
      --block-size 4KiB --batch 1 --duration 2s --warmup 300ms --json 2>/dev/null |
      python3 -c 'import json,sys
d = json.loads(sys.stdin.readline())
print("  %-8s %-6s %8.1f %8.1f" % (sys.argv[1], d["op"], d["lat_us_p50"], d["lat_us_p99"]))' $path
  done
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  pid=
done
