#!/usr/bin/env bash
# Same-host peers against the socket, in one command: te bench against a `te serve` in
# a second process of this host, through the same-host channel (the default) and with
# `local_ipc = false` (every frame over loopback tcp, device memory staged through
# pinned host memory), alternated, best of TE_REPS (3) each. Prints the table and
# checks the targets for the memory kind:
#
#   host       channel >= 1.5 x socket at 1 MiB x 64 (write and read)
#   fakedev:N  channel >= 3 x socket at 32 KiB x 128
#   cuda:N     channel >= 20 x socket and >= 150 GB/s at 1 MiB x 64, >= 100 GB/s at
#              32 KiB x 128
#
# Then KV blocks (`te bench --kv` against a `te serve --kv`, the default 8B-class
# geometry, 64 blocks per batch) through the channel: random block ids >= 0.8 x
# contiguous ones, both ways.
#
# Usage: scripts/same-host-bench.sh [path/to/te] [mem] [seconds per point]
#   (defaults: target/release/te, fakedev:0, 2). Exits 1 if a target is missed.
set -euo pipefail
cd "$(dirname "$0")/.."
te=${1:-target/release/te}
mem=${2:-fakedev:0}
secs=${3:-2}
reps=${TE_REPS:-3}
. scripts/serve.sh
serve --buffer-size 1GiB
printf '[engine]\nbackend = "tcp"\n[backends.tcp]\nlocal_ipc = false\n' >"$work/socket.toml"
printf '[engine]\nbackend = "tcp"\n' >"$work/channel.toml"
results="$work/results.jsonl"
for shape in "32KiB 128" "1MiB 64" "4KiB 1"; do
  set -- $shape
  for op in write read; do
    for _ in $(seq "$reps"); do
      for path in channel socket; do
        line=$("$te" bench --config "$work/$path.toml" --target "$target" --mem "$mem" \
          --op "$op" --block-size "$1" --batch "$2" --duration "${secs}s" --warmup 500ms \
          --json 2>/dev/null | head -n1)
        echo "{\"path\": \"$path\", \"shape\": \"$1 x $2\", \"r\": $line}" >>"$results"
      done
    done
  done
done
echo "== $mem, target in another process of this host (best of $reps, ${secs}s each)"
status=0
python3 - "$results" "$mem" <<'PY' || status=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
mem = sys.argv[2].split(":")[0]
def best(path, shape, op, key="gb_per_s", low=False):
    v = [r["r"][key] for r in rows if r["path"] == path and r["shape"] == shape and r["r"]["op"] == op]
    return (min(v) if low else max(v)) if v else float("nan")
ok = True
print(f"{'shape':<14}{'op':<7}{'socket GB/s':>12}{'channel GB/s':>13}{'ratio':>8}  target")
for shape in ["32KiB x 128", "1MiB x 64"]:
    for op in ["write", "read"]:
        s, c = best("socket", shape, op), best("channel", shape, op)
        ratio = c / s if s else 0.0
        target, good = "", True
        if mem == "host" and shape == "1MiB x 64":
            target, good = ">= 1.5 x", ratio >= 1.5
        if mem == "fakedev" and shape == "32KiB x 128":
            target, good = ">= 3 x", ratio >= 3
        if mem == "cuda" and shape == "1MiB x 64":
            target, good = ">= 20 x and 150 GB/s", ratio >= 20 and c >= 150
        if mem == "cuda" and shape == "32KiB x 128":
            target, good = ">= 100 GB/s", c >= 100
        ok &= good
        mark = "" if not target else ("ok" if good else "MISSED")
        print(f"{shape:<14}{op:<7}{s:>12.2f}{c:>13.2f}{ratio:>8.2f}  {target} {mark}")
for op in ["write", "read"]:
    s = best("socket", "4KiB x 1", op, "lat_us_p50", True)
    c = best("channel", "4KiB x 1", op, "lat_us_p50", True)
    print(f"{'4KiB x 1 p50':<14}{op:<7}{s:>10.1f}µs{c:>11.1f}µs{c / s if s else 0:>8.2f}")
sys.exit(0 if ok else 1)
PY
kill "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
serve --kv
# Where the copies are the CPU's (host, fakedev), one thread's memcpy of the same blocks
# shows what random ids can reach on this machine.
baseline=--baseline
case $mem in cuda*) baseline= ;; esac
for op in read write; do
  "$te" bench --backend tcp --kv --target "$target" --mem "$mem" --op "$op" --batch 64 \
    --duration "${secs}s" $baseline --json 2>/dev/null >>"$work/kv.jsonl"
done
echo "== $mem KV blocks, target in another process of this host (64 blocks per batch)"
python3 - "$work/kv.jsonl" <<'PY' || status=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ok = True
for op in ["read", "write"]:
    gb = {r["mode"]: r["gb_per_s"] for r in rows if r["op"] == op}
    ratio = gb["random"] / gb["contiguous"]
    good = ratio >= 0.8
    ok &= good
    print(f"{op:<6} contiguous {gb['contiguous']:8.2f} GB/s  random {gb['random']:8.2f} GB/s  "
          f"random/contiguous {ratio:.2f}  (>= 0.8) {'ok' if good else 'MISSED'}")
    if "memcpy-random" in gb:
        print(f"       memcpy of the same blocks: random/contiguous "
              f"{gb['memcpy-random'] / gb['memcpy-contiguous']:.2f}, "
              f"te random / memcpy random {gb['random'] / gb['memcpy-random']:.2f}")
sys.exit(0 if ok else 1)
PY
exit $status
