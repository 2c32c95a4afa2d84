#!/usr/bin/env bash
# Device memory against host memory over tcp, in one run: `te bench --backend tcp`
# with a target in this process, 32 KiB x 128 blocks, WRITE and READ, from fakedev:0
# (with its default cost model) and from host memory, alternated five times; the
# best of each is compared. Fails if fakedev:0 moves less than 0.8 x what host memory
# moves (issue 15's target). The same shape with `local_copies = false` (staged through
# pinned host memory and the socket, as for a peer in another process) is printed too,
# not checked: on a 2-core machine its four CPU copies per byte cost what they cost.
#
# Usage: scripts/fakedev-ratio.sh [path/to/te]   (default: target/debug/te)
set -euo pipefail
cd "$(dirname "$0")/.."
te=${1:-target/debug/te}
staged=$(mktemp)
trap 'rm -f "$staged"' EXIT
printf '[engine]\nbackend = "tcp"\n[backends.tcp]\nlocal_copies = false\n' >"$staged"

gbps() { # op, then te bench arguments
  local op=$1
  shift
  "$te" bench --backend tcp --op "$op" --block-size 32KiB --batch 128 \
    --duration 1s --warmup 200ms --json "$@" 2>/dev/null |
    python3 -c 'import json, sys; print(json.loads(sys.stdin.readline())["gb_per_s"])'
}

status=0
for op in write read; do
  host=() dev=() stg=()
  for _ in 1 2 3 4 5; do
    host+=("$(gbps "$op" --mem host)")
    dev+=("$(gbps "$op" --mem fakedev:0)")
    stg+=("$(gbps "$op" --mem fakedev:0 --config "$staged")")
  done
  python3 - "$op" "${host[*]}" "${dev[*]}" "${stg[*]}" <<'PY' || status=1
import sys
op, host, dev, stg = sys.argv[1], *[[float(x) for x in a.split()] for a in sys.argv[2:]]
ratio = max(dev) / max(host)
print(f"{op} 32KiB x 128 GB/s  host {host}  fakedev:0 {dev}  staged {stg}")
print(f"{op}: fakedev:0 / host = {ratio:.2f} (best of 5; at least 0.80), "
      f"staged / host = {max(stg) / max(host):.2f} (not checked)")
sys.exit(0 if ratio >= 0.8 else 1)
PY
done
exit $status
