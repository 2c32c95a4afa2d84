#!/usr/bin/env bash
# The same-host channel with and without `caller_reads` (a caller waiting for its
# batch reads its answer itself), alternated against one `te serve` in a second
# process of this host, best of REPS each: the 4 KiB x 1 round trip (p50) and the
# single-stream bandwidth at 32 KiB x 128 and 1 MiB x 64, write and read.
#
# Usage: scripts/caller-reads-bench.sh [path/to/te] [mem] [seconds per point] [reps]
#   (defaults: target/release/te, fakedev:0, 2, 3).
# Environment: PIN_SERVE / PIN_BENCH, CPU lists for taskset (e.g. 0 and 0: both on
# one CPU; 1 and 0: one CPU each); SERVE_TOML, lines added to the server's
# configuration (e.g. '[runtimes.fakedev]\ncompletion_latency = "30us"': a target
# that sleeps in its copies, as one waiting for a GPU event does).
set -euo pipefail
cd "$(dirname "$0")/.."
te=${1:-target/release/te}
mem=${2:-fakedev:0}
secs=${3:-2}
reps=${4:-3}
all=$(seq -s, 0 $(($(nproc) - 1)))
pin_serve=${PIN_SERVE:-$all}
pin_bench=${PIN_BENCH:-$all}
# Without taskset (util-linux), nothing is pinned.
pin() { if command -v taskset >/dev/null; then echo "taskset -c $1"; fi; }
serve_wrap=$(pin "$pin_serve")
bench_wrap=$(pin "$pin_bench")
. scripts/serve.sh
printf '[engine]\nbackend = "tcp"\n%b\n' "${SERVE_TOML:-}" >"$work/serve.toml"
printf '[engine]\nbackend = "tcp"\n[backends.tcp]\ncaller_reads = false\n' >"$work/off.toml"
printf '[engine]\nbackend = "tcp"\n[backends.tcp]\ncaller_reads = true\n' >"$work/on.toml"
serve --buffer-size 256MiB --config "$work/serve.toml"
for shape in "4KiB 1" "32KiB 128" "1MiB 64"; do
  set -- $shape
  for op in write read; do
    for _ in $(seq "$reps"); do
      for mode in off on; do
        line=$($bench_wrap "$te" bench --config "$work/$mode.toml" --target "$target" \
          --mem "$mem" --op "$op" --block-size "$1" --batch "$2" --duration "${secs}s" \
          --warmup 300ms --json 2>/dev/null | head -n1)
        echo "{\"mode\": \"$mode\", \"shape\": \"$1 x $2\", \"r\": $line}" >>"$work/results.jsonl"
      done
    done
  done
done
echo "== $mem, same-host channel, caller_reads off / on (best of $reps, ${secs}s each; server on CPUs $pin_serve, bench on $pin_bench)"
python3 - "$work/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def best(mode, shape, op, key, low):
    v = [r["r"][key] for r in rows if r["mode"] == mode and r["shape"] == shape and r["r"]["op"] == op]
    return (min(v) if low else max(v)) if v else float("nan")
print(f"{'shape':<13}{'op':<7}{'off':>10}{'on':>10}  on / off")
for shape, key, low, unit in [("4KiB x 1", "lat_us_p50", True, "µs p50"),
                              ("32KiB x 128", "gb_per_s", False, "GB/s"),
                              ("1MiB x 64", "gb_per_s", False, "GB/s")]:
    for op in ["write", "read"]:
        a, b = best("off", shape, op, key, low), best("on", shape, op, key, low)
        print(f"{shape:<13}{op:<7}{a:>10.1f}{b:>10.1f}  {b / a if a else 0:.2f} ({unit})")
PY
