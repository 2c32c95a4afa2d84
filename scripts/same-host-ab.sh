#!/usr/bin/env bash
# Two te binaries alternated through the same-host channel: each runs `te serve` and
# `te bench --target` (4 KiB × 1 and 32 KiB × 128, write and read, 2 s per point) on
# memory MEM, REPS times in turn; one line per point, sorted by shape, op and binary.
#
# Usage: scripts/same-host-ab.sh OLD NEW MEM [REPS]   (MEM: host, fakedev:0, cuda:0)
set -euo pipefail
cd "$(dirname "$0")/.."
old=$1
new=$2
mem=$3
reps=${4:-3}
source scripts/serve.sh
for _ in $(seq "$reps"); do
  for te in "$old" "$new"; do
    serve --buffer-size 256MiB
    for shape in "4KiB 1" "32KiB 128"; do
      set -- $shape
      for op in write read; do
        "$te" bench --backend tcp --target "$target" --mem "$mem" --op "$op" \
          --block-size "$1" --batch "$2" --duration 2s --warmup 300ms --json 2>/dev/null |
          python3 -c 'import json,sys
d = json.loads(sys.stdin.readline())
print("%-10s %-6s %-4s %8.2f GB/s  p50 %7.1f us" % (sys.argv[2], d["op"], sys.argv[1], d["gb_per_s"], d["lat_us_p50"]))' \
            "$([ "$te" = "$old" ] && echo old || echo new)" "$1x$2"
      done
    done
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=
  done
done | sort -s -k1,1 -k2,2 -k3,3
