#!/usr/bin/env bash
# What one request of a KV batch costs te on the CPU: `te bench --kv` with blocks of
# 8 bytes (1 head × 4 dims × 1 token, 2-byte elements), so the copies cost next to
# nothing and a batch's time is te's own work. 64 blocks per batch: contiguous ids
# merge into 64 requests (one per layer slot), random ids are 4,096. The cost of one
# request is the difference of the two p50s over the difference of their counts.
#
#   bash scripts/kv-per-request.sh [TE] [MEM] [SECONDS]
#
# Runs the target in this process (device copies) and in a `te serve --kv` of its own
# (the same-host channel). On fakedev its modelled launch and sync costs are set to
# zero; on cuda:0 the GPU's are real.
set -euo pipefail
cd "$(dirname "$0")/.."
te=${1:-target/release/te}
mem=${2:-fakedev:0}
secs=${3:-2}
. scripts/serve.sh
printf '[engine]\nbackend = "tcp"\n[runtimes.fakedev]\nlaunch_cost = "0us"\nsync_cost = "0us"\n' >"$work/te.toml"
geometry=(--kv-heads 1 --kv-head-dim 4 --kv-block-tokens 1 --config "$work/te.toml")
bench() {
  "$te" bench --kv --backend tcp --mem "$mem" --batch 64 --duration "${secs}s" --json "${geometry[@]}" "$@" 2>/dev/null
}
for op in read write; do
  bench --op "$op" | sed "s/^/this-process /" >>"$work/rows"
done
serve --kv "${geometry[@]}"
for op in read write; do
  bench --op "$op" --target "$target" | sed "s/^/other-process /" >>"$work/rows"
done
python3 - "$work/rows" "$mem" <<'PY'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    where, _, j = line.partition(" ")
    if j.strip().startswith("{"):
        r = json.loads(j)
        rows[(where, r["op"], r["mode"])] = r
print(f"== {sys.argv[2]}: KV batches of 64 blocks of 8 bytes (p50 per batch)")
print(f"{'target':<15}{'op':<7}{'contiguous':>16}{'random':>18}{'per request':>13}")
for where in ["this-process", "other-process"]:
    for op in ["read", "write"]:
        c, r = rows.get((where, op, "contiguous")), rows.get((where, op, "random"))
        if not (c and r):
            continue
        extra = r["requests_per_batch"] - c["requests_per_batch"]
        ns = (r["lat_us_p50"] - c["lat_us_p50"]) * 1000 / extra if extra else 0
        print(f"{where:<15}{op:<7}{c['lat_us_p50']:>8.1f} µs ({c['requests_per_batch']:>4.0f}){r['lat_us_p50']:>9.1f} µs ({r['requests_per_batch']:>4.0f}){ns:>10.0f} ns")
PY
