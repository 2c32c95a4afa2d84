#!/usr/bin/env bash
# Everything te checks on an NVIDIA GPU, in one command: the GPU tests (tests/gpu.rs,
# every byte of staged, device-to-device, mixed, KV and two-process transfers verified
# on cuda:0), the list-copy kernel assembled by ptxas for three GPU generations where
# the toolkit is installed, `te probe` (thread wake-ups, socket round trips and device
# copies timed alone), then scripts/gpu-bench.sh's table (staged, as between
# hosts), scripts/same-host-bench.sh's (two processes of this host),
# scripts/caller-reads-bench.sh's (the same-host channel with and without
# `caller_reads`) and scripts/kv-per-request.sh's (te's CPU cost per request of a KV
# batch). With an older
# te beside the new one (`te-before`), its staged table follows, measured in the same
# sitting.
#
# Usage: scripts/gpu-check.sh [DIR] [seconds per point]
#   DIR holds prebuilt binaries: `te` (release), `gpu` (the tests/gpu.rs test binary),
#   optionally `te-core` (te-core's unit tests) and `te-before`. Without DIR they are
#   built here with cargo (release). Exits 1 if a test failed or a target was missed.
#
#        scripts/gpu-check.sh --build DIR
#   only builds them into DIR, stripped (a machine with a GPU but no Rust toolchain
#   then runs `scripts/gpu-check.sh DIR` on a copy of the tree that carries DIR).
set -uo pipefail
cd "$(dirname "$0")/.."
build_only=
if [ "${1:-}" = --build ]; then
  build_only=1
  shift
  [ -n "${1:-}" ] || { echo "usage: scripts/gpu-check.sh --build DIR" >&2; exit 2; }
fi
dir=${1:-}
secs=${2:-2}
if [ -z "$dir" ] || [ -n "$build_only" ]; then
  dir=${dir:-target/release/gpu-check}
  mkdir -p "$dir"
  cargo build --release --bin te && cp target/release/te "$dir/te" || exit 1
  for t in "--test gpu:gpu" "-p te-core --lib --features cuda:te-core"; do
    bin=$(cargo test --release ${t%%:*} --no-run --message-format=json 2>/dev/null |
      python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("profile", {}).get("test") and m.get("executable"): print(m["executable"])' | tail -n1)
    [ -n "$bin" ] && cp "$bin" "$dir/${t##*:}"
  done
  if [ -n "$build_only" ]; then
    for f in te gpu te-core; do
      [ -f "$dir/$f" ] && strip "$dir/$f"
    done
    ls -l "$dir"
    exit 0
  fi
fi
fail=0
echo "== GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || fail=1

echo "== tests/gpu.rs"
TE_BIN="$dir/te" timeout 300 "$dir/gpu" --ignored --test-threads=1 || fail=1

ptxas=$(command -v ptxas || ls /usr/local/cuda/bin/ptxas 2>/dev/null || true)
if [ -x "$dir/te-core" ] && [ -n "$ptxas" ]; then
  echo "== the list-copy kernel through $ptxas"
  TE_PTXAS=$ptxas timeout 120 "$dir/te-core" ptxas_accepts --nocapture || fail=1
fi

echo "== te probe: what the steps of a small transfer cost here, each alone"
timeout 180 scripts/round-trips.sh "$dir/te" "${TE_GPU_MEM:-cuda:0}" || fail=1

echo "== te bench: this te, staged as between hosts"
scripts/gpu-bench.sh "$dir/te" "$secs" || fail=1
echo "== te bench: two processes of this host, channel against socket"
TE_REPS=2 scripts/same-host-bench.sh "$dir/te" "${TE_GPU_MEM:-cuda:0}" "$secs" || fail=1
echo "== te bench --kv: what one request of a KV batch costs on the CPU"
scripts/kv-per-request.sh "$dir/te" "${TE_GPU_MEM:-cuda:0}" 1 || fail=1
echo "== te bench: the same-host channel with and without caller_reads"
scripts/caller-reads-bench.sh "$dir/te" "${TE_GPU_MEM:-cuda:0}" 1 2 || fail=1
if [ -x "$dir/te-before" ]; then
  echo "== te bench: te-before (the same table, one point each, for comparison)"
  TE_GPU_OLD=1 TE_GPU_REPS=1 scripts/gpu-bench.sh "$dir/te-before" "$secs" || true
fi
exit $fail
