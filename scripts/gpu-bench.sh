#!/usr/bin/env bash
# Device memory against host memory on an NVIDIA GPU, in one command: the table of
# issue 29's GPU targets. The target runs in a second process (`te serve`), as a
# prefill and a decode instance on two hosts would, so device memory is staged through
# pinned host memory and the socket on both sides (`local_ipc = false`: no same-host
# channel; scripts/same-host-bench.sh measures that). For each shape,
# host and cuda:0 are alternated three times and the best of each is compared:
#
#   cuda ÷ host  >= 0.9   at 32 KiB x 128, 64 KiB x 128 and 1 MiB x 64, write and read
#   4 KiB round trip (batch of 1, p50): cuda <= 1.5 x host, write and read
#   te bench --kv --mem cuda:0: random ids >= 0.8 x contiguous, read and write
#
# It also prints `te info`'s copy path (which driver calls carry a group) and, per
# point, the device calls, copies and synchronisations per batch that `te bench --json`
# reports, and where a batch's time went (its telemetry's stages: post, queued, wire,
# device, and the waiting thread's wake-up). Exits 1 if a target is missed (the table
# is printed either way).
#
# Needs: an NVIDIA driver, python3, and the prebuilt binary (cargo build --release).
# Usage: scripts/gpu-bench.sh [path/to/te] [seconds per point]   (default:
# target/release/te, 2). TE_GPU_REPS sets how often each point is alternated (3). TE_GPU_MEM=fakedev:0 runs the same table on the fake device,
# to check the script on a machine without a GPU (its numbers say nothing of a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
te=${1:-target/release/te}
secs=${2:-2}
mem=${TE_GPU_MEM:-cuda:0}
reps=${TE_GPU_REPS:-3}
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
# Two processes of one host would take the same-host channel: this table is the
# staged path between hosts.
config="$work/staged.toml"
if [ -n "${TE_GPU_OLD:-}" ]; then
  # A te from before the same-host channel knows no `local_ipc` (and needs none).
  printf '[engine]\nbackend = "tcp"\n' >"$config"
else
  printf '[engine]\nbackend = "tcp"\n[backends.tcp]\nlocal_ipc = false\n' >"$config"
fi

echo "== te info (device runtimes and how their copies are submitted)"
"$te" info | sed -n '/device runtimes:/,$p'
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

# A target per memory kind, each in its own process (started here, not in a command
# substitution's subshell, so that the exit trap knows and kills it).
serve() { # kind
  local out="$work/serve-${1//:/_}"
  "$te" serve --config "$config" --mem "$1" --buffer-size 1GiB >"$out" 2>"$out.err" &
  pids+=($!)
  for _ in $(seq 100); do
    [ -s "$out" ] && break
    sleep 0.1
  done
  [ -s "$out" ] || { echo "te serve --mem $1 did not start:" >&2; cat "$out.err" >&2; exit 1; }
}
serve host
serve "$mem"
host_target=$(head -n1 "$work/serve-host")
cuda_target=$(head -n1 "$work/serve-${mem//:/_}")

point() { # kind target op block batch
  "$te" bench --config "$config" --target "$2" --mem "$1" --op "$3" --block-size "$4" \
    --batch "$5" --duration "${secs}s" --warmup 500ms --json 2>/dev/null | head -n1
}

results="$work/results.jsonl"
for shape in "32KiB 128" "64KiB 128" "1MiB 64" "4KiB 1"; do
  set -- $shape
  for op in write read; do
    for _ in $(seq "$reps"); do
      for kind in host "$mem"; do
        target=$host_target
        [ "$kind" = host ] || target=$cuda_target
        line=$(point "$kind" "$target" "$op" "$1" "$2")
        [ "$kind" = host ] || kind=device
        echo "{\"mem\": \"$kind\", \"shape\": \"$1 x $2\", \"r\": $line}" >>"$results"
      done
    done
  done
done
for op in read write; do
  "$te" bench --kv --backend tcp --mem "$mem" --op "$op" --duration "${secs}s" --json 2>/dev/null |
    sed "s/^/{\"kv\": \"$op\", \"r\": /; s/\$/}/" >>"$results"
done

echo
echo "== $mem against host memory, target in another process (best of $reps, ${secs}s each)"
python3 - "$results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ok = True
def best(mem, shape, op, key="gb_per_s", low=False):
    v = [r["r"][key] for r in rows if r.get("mem") == mem and r.get("shape") == shape and r["r"]["op"] == op]
    return (min(v) if low else max(v)) if v else float("nan")
def dev(shape, op):
    r = [r["r"] for r in rows if r.get("mem") == "device" and r.get("shape") == shape and r["r"]["op"] == op][-1]
    f = lambda k: "-" if r.get(k) is None else f"{r[k]:.1f}"
    return f"{f('device_calls_per_batch')}/{f('device_copies_per_batch')}/{f('device_syncs_per_batch')}"
print()
print(f"{'shape':<17}{'op':<7}{'host GB/s':>10}{'dev GB/s':>10}{'ratio':>8}  target   calls/copies/syncs per batch")
for shape in ["32KiB x 128", "64KiB x 128", "1MiB x 64"]:
    for op in ["write", "read"]:
        h, c = best("host", shape, op), best("device", shape, op)
        ratio = c / h if h else 0.0
        good = ratio >= 0.9
        ok &= good
        print(f"{shape:<17}{op:<7}{h:>10.2f}{c:>10.2f}{ratio:>8.2f}  >= 0.90 {'ok' if good else 'MISSED'}  {dev(shape, op)}")
for op in ["write", "read"]:
    h = best("host", "4KiB x 1", op, "lat_us_p50", low=True)
    c = best("device", "4KiB x 1", op, "lat_us_p50", low=True)
    ratio = c / h if h else 0.0
    good = ratio <= 1.5
    ok &= good
    print(f"{'4KiB x 1 p50':<17}{op:<7}{h:>8.1f}µs{c:>8.1f}µs{ratio:>8.2f}  <= 1.50 {'ok' if good else 'MISSED'}  {dev('4KiB x 1', op)}")
for op in ["read", "write"]:
    kv = {r["r"]["mode"]: r["r"] for r in rows if r.get("kv") == op}
    if "random" in kv and "contiguous" in kv:
        ratio = kv["random"]["gb_per_s"] / kv["contiguous"]["gb_per_s"]
        good = ratio >= 0.8
        ok &= good
        calls = kv["random"].get("device_calls_per_batch")
        calls = "-" if calls is None else f"{calls:.1f}"
        print(f"{'kv random/contig':<17}{op:<7}{kv['contiguous']['gb_per_s']:>10.2f}{kv['random']['gb_per_s']:>10.2f}{ratio:>8.2f}  >= 0.80 {'ok' if good else 'MISSED'}  random: {calls} calls/batch")
    else:
        ok = False
        print(f"kv {op}: no result")
print()
print("where a batch's time went (medians in µs of the last run of each point; stages overlap):")
print(f"{'shape':<17}{'op':<7}{'memory':<8}{'latency':>9}{'post':>8}{'queued':>8}{'wire':>8}{'device':>8}{'wake':>8}")
for shape in ["32KiB x 128", "64KiB x 128", "1MiB x 64", "4KiB x 1"]:
    for op in ["write", "read"]:
        for mem in ["host", "device"]:
            r = [r["r"] for r in rows if r.get("mem") == mem and r.get("shape") == shape and r["r"]["op"] == op]
            if not r:
                continue
            r = r[-1]
            f = lambda k: "-" if r.get(k) is None else f"{r[k]:.1f}"
            print(f"{shape:<17}{op:<7}{mem:<8}{f('lat_us_p50'):>9}{f('post_us_p50'):>8}{f('queued_us_p50'):>8}{f('wire_us_p50'):>8}{f('device_us_p50'):>8}{f('wake_us_p50'):>8}")
sys.exit(0 if ok else 1)
PY
