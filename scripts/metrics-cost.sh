#!/usr/bin/env bash
# What metrics cost, in one command: te bench on the tcp backend (target in the bench's
# process) with `[engine] metrics = true` (the default) and `false`, alternated, best of
# TE_REPS (5) each, at 4 KiB x 1 (latency) and 64 KiB x 128 (throughput). Prints both,
# the throughput ratio and the p50 difference, against the targets (<= 2 % and <= 1 µs).
# On a shared machine the run-to-run noise can exceed both: rerun before believing a
# miss. Usage: scripts/metrics-cost.sh [path/to/te] [seconds per point]
set -euo pipefail
cd "$(dirname "$0")/.."
te=${1:-target/release/te}
secs=${2:-2}
reps=${TE_REPS:-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for m in true false; do
  printf '[engine]\nbackend = "tcp"\nmetrics = %s\n' "$m" >"$work/$m.toml"
done
for shape in "4KiB 1" "64KiB 128"; do
  set -- $shape
  for _ in $(seq "$reps"); do
    for m in true false; do
      line=$("$te" bench --config "$work/$m.toml" --block-size "$1" --batch "$2" \
        --duration "${secs}s" --warmup 500ms --json 2>/dev/null | head -n1)
      echo "{\"metrics\": $m, \"shape\": \"$1 x $2\", \"r\": $line}" >>"$work/r.jsonl"
    done
  done
done
python3 - "$work/r.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def best(m, shape, key, low=False):
    v = [r["r"][key] for r in rows if r["metrics"] == m and r["shape"] == shape]
    return min(v) if low else max(v)
ok = True
for shape in ["4KiB x 1", "64KiB x 128"]:
    on, off = best(True, shape, "gb_per_s"), best(False, shape, "gb_per_s")
    p_on, p_off = best(True, shape, "lat_us_p50", True), best(False, shape, "lat_us_p50", True)
    cost = 1 - on / off
    good = cost <= 0.02 and p_on - p_off <= 1.0
    ok &= good
    print(f"{shape:<12} metrics on {on:7.3f} GB/s p50 {p_on:8.1f} µs | off {off:7.3f} GB/s p50 {p_off:8.1f} µs | "
          f"throughput cost {cost * 100:+.1f} %, p50 {p_on - p_off:+.1f} µs  {'ok' if good else 'MISSED'}")
sys.exit(0 if ok else 1)
PY
