"""``python -m te.bench``: te's throughput from Python, with `te bench`'s options.

A target and an initiator engine run in this process and talk over loopback; the
initiator submits batches of ``--batch`` requests of ``--block-size`` bytes and waits
for each (GIL released), as ``te bench`` does. ``--compare PATH`` runs the Rust
``te bench`` binary at PATH with the same options in the same run and prints the
ratio of the two throughputs; ``--repeat N`` does that N times, alternating which
side goes first, and ends with the medians.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

from . import Engine

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "kb": 1000, "mib": 1 << 20, "mb": 10**6,
          "gib": 1 << 30, "gb": 10**9}


def parse_size(s):
    """``4096``, ``64KiB``, ``1MiB`` → bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", s)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"`{s}` is not a size like 4096, 64KiB or 1MiB")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_time(s):
    """``5s``, ``500ms`` → seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"`{s}` is not a time like 5s or 500ms")
    return float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)


def measure(backend, op, block, batch, duration, warmup, config=None):
    """Bytes per second moved by batches of ``batch`` × ``block`` bytes."""
    cfg = config or {"engine": {"backend": backend}}
    if backend and isinstance(cfg, dict):
        cfg.setdefault("engine", {})["backend"] = backend
    with Engine(cfg) as target, Engine(cfg) as initiator:
        size = block * batch
        remote = bytearray(size)
        local = bytearray(b"\x5a" * size)
        rreg = target.register_buffer(remote, name="bench")
        lreg = initiator.register_buffer(local)
        peer = initiator.connect(target.address)
        reqs = [(lreg.id, i * block, rreg.id, i * block, block) for i in range(batch)]

        def run(seconds):
            end = time.perf_counter() + seconds
            n = 0
            start = time.perf_counter()
            while True:
                initiator.transfer(peer, reqs, op=op).wait()
                n += 1
                now = time.perf_counter()
                if now >= end:
                    return n * size, now - start

        if warmup > 0:
            run(warmup)
        moved, secs = run(duration)
        if op == "write" and remote != local:
            raise SystemExit("te.bench: the target's bytes differ from the source's")
        lreg.deregister()
        rreg.deregister()
        return moved / secs


def measure_kv(backend, op, batch, duration, warmup, model, config=None):
    """``{mode: bytes per second}`` of block pulls (``read``) or pushes (``write``) of a
    simulated model's KV cache, as ``te bench --kv`` measures them: ``contiguous``
    (one run of ids on both sides) and ``random`` (distinct random ids)."""
    try:
        import numpy as np
    except ImportError:
        raise SystemExit("te.bench: --kv needs numpy (pip install numpy)") from None

    layers, bpb, blocks = model["layers"], model["bytes_per_block"], model["blocks"]
    if batch > blocks:
        raise SystemExit(f"te.bench: --batch {batch} exceeds --kv-blocks {blocks}")
    cfg = config or {"engine": {"backend": backend}}
    if backend and isinstance(cfg, dict):
        cfg.setdefault("engine", {})["backend"] = backend
    rng = np.random.default_rng()
    out = {}
    with Engine(cfg) as target, Engine(cfg) as initiator:
        sides = []
        for e in (target, initiator):
            big = np.zeros((layers, 2, blocks, bpb), np.uint8)
            e.register_kv_caches("kv", [(big[i, 0], big[i, 1]) for i in range(layers)])
            sides.append(big)
        peer = initiator.connect(target.address)
        move = initiator.pull_blocks if op == "read" else initiator.push_blocks
        per_batch = batch * bpb * 2 * layers
        for mode in ("contiguous", "random"):
            def ids():
                if mode == "contiguous":
                    first = int(rng.integers(0, blocks - batch + 1))
                    r = np.arange(first, first + batch, dtype=np.int64)
                    return r, r
                return (rng.permutation(blocks)[:batch].astype(np.int64),
                        rng.permutation(blocks)[:batch].astype(np.int64))

            def run(seconds):
                end = time.perf_counter() + seconds
                n, start = 0, time.perf_counter()
                while True:
                    remote, local = ids()
                    move(peer, "kv", local, remote).wait()
                    n += 1
                    now = time.perf_counter()
                    if now >= end:
                        return n * per_batch / (now - start)

            if warmup > 0:
                run(warmup)
            out[mode] = run(duration)
        for e in (initiator, target):
            e.deregister_kv_caches("kv")
    return out


def rust_bench(path, args):
    """`te bench`'s throughput (bytes/s) with the same options, from its --json."""
    cmd = [path, "bench", "--json", "--op", args.op, "--batch", str(args.batch),
           "--duration", f"{args.duration}s"]
    if args.kv:
        cmd += ["--kv", "--kv-layers", str(args.kv_layers), "--kv-heads", str(args.kv_heads),
                "--kv-head-dim", str(args.kv_head_dim),
                "--kv-block-tokens", str(args.kv_block_tokens),
                "--kv-dtype-bytes", str(args.kv_dtype_bytes), "--kv-blocks", str(args.kv_blocks)]
    else:
        # `--kv` measures each mode once, with no warm-up of its own to set.
        cmd += ["--block-size", str(args.block_size), "--warmup", f"{args.warmup}s"]
    if args.backend:
        cmd += ["--backend", args.backend]
    if args.config:
        cmd += ["--config", args.config]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{"):
            rec = json.loads(line)
            if not rec.get("backend", "").startswith("baseline"):
                found[rec.get("mode", "")] = rec["gb_per_s"] * 1e9
    if not found:
        raise SystemExit(f"te.bench: no result in `{' '.join(cmd)}` output:\n{out}")
    return found


def _report(args, rec, value):
    ratio = rec["impl"] == "python/rust"
    rec["ratio" if ratio else "gb_per_s"] = value
    if args.json:
        print(json.dumps(rec))
        return
    what = f"ratio {value:.3f}" if ratio else f"{value:.3f} GB/s"
    print(f"{rec['round']!s:>6}  {rec['impl']:>11}  {rec['mode'] or '-':>10}  {rec['op']} "
          f"{rec['block_size']} B × {rec['batch_size']}: {what}")


def main(argv=None):
    """The command line."""
    p = argparse.ArgumentParser(prog="python -m te.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="configuration file (default: $TE_CONFIG, else defaults)")
    p.add_argument("--backend", help="backend name, overriding the configuration")
    p.add_argument("--op", choices=["write", "read"],
                   help="write pushes, read pulls [default: write; read with --kv]")
    p.add_argument("--block-size", type=parse_size, default=64 << 10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--duration", type=parse_time, default=5.0)
    p.add_argument("--warmup", type=parse_time, default=1.0)
    p.add_argument("--json", action="store_true", help="one JSON object per result")
    p.add_argument("--kv", action="store_true",
                   help="move a simulated model's KV cache by block id; --batch is blocks per batch")
    p.add_argument("--kv-layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--kv-head-dim", type=int, default=128)
    p.add_argument("--kv-block-tokens", type=int, default=16)
    p.add_argument("--kv-dtype-bytes", type=int, default=2)
    p.add_argument("--kv-blocks", type=int, default=256)
    p.add_argument("--compare", metavar="TE_BINARY",
                   help="also run `TE_BINARY bench` with the same options and print the ratio")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds (alternating which side runs first); medians at the end")
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error("--batch must be at least 1")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    args.op = args.op or ("read" if args.kv else "write")
    if args.kv:
        bpb = args.kv_heads * args.kv_head_dim * args.kv_block_tokens * args.kv_dtype_bytes
        model = {"layers": args.kv_layers, "bytes_per_block": bpb, "blocks": args.kv_blocks}
        block = bpb

        def python():
            return measure_kv(args.backend, args.op, args.batch, args.duration, args.warmup,
                              model, args.config)
    else:
        block = args.block_size

        def python():
            return {"": measure(args.backend, args.op, args.block_size, args.batch,
                                args.duration, args.warmup, args.config)}

    base = {"backend": args.backend or "", "op": args.op, "block_size": block,
            "batch_size": args.batch}
    results = {}  # mode -> {"python": [...], "rust": [...], "python/rust": [...]}
    for rnd in range(args.repeat):
        # Alternate which side runs first, so neither always gets the quieter half.
        if args.compare and rnd % 2:
            rs = rust_bench(args.compare, args)
            py = python()
        else:
            py = python()
            rs = rust_bench(args.compare, args) if args.compare else {}
        for mode, bps in py.items():
            got = {"python": bps / 1e9}
            if mode in rs:
                got["rust"] = rs[mode] / 1e9
                got["python/rust"] = bps / rs[mode]
            for impl, v in got.items():
                results.setdefault(mode, {}).setdefault(impl, []).append(v)
                _report(args, dict(base, impl=impl, mode=mode, round=rnd + 1), v)
    if args.repeat > 1:
        for mode, by in results.items():
            for impl, vs in by.items():
                _report(args, dict(base, impl=impl, mode=mode, round="median"),
                        statistics.median(vs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
