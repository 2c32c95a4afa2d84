#!/usr/bin/env python3
"""Batches of KV blocks through te.mooncake, Mooncake's wheel and te's native API, in
one run: ``target/venv/bin/python scripts/bench-mooncake.py``.

A target process owns a pool of ``--pool`` blocks of ``--block-size`` random bytes; an
initiator process moves ``--blocks`` distinct random blocks per batch between its own
pool and the target's, one synchronous batch after the other, as the frameworks call
Mooncake (``batch_transfer_sync_write`` / ``_read``): WRITE pushes blocks of the
initiator's pool into the target's, READ pulls them. The batches (which blocks go
where) are drawn once and shared by every implementation.

- ``te.mooncake``: ``from te.mooncake import TransferEngine``, raw addresses in lists.
- ``native``: te's own API on the same engine, connection and memory as te.mooncake
  (in the same pair of processes): ``Engine.transfer`` with an ``N×5`` array of
  (region, offset) requests, then ``Handle.wait()``.
- ``mooncake``: Mooncake's wheel (``mooncake-transfer-engine``), TCP on loopback, in
  its own pair of processes. Without NVIDIA's driver it needs a ``libcuda.so.1``: the
  script builds crates/te-python/tests/fakecuda/fake_libcuda.c with ``cc`` (a driver
  that reports no device) and puts the CUDA runtime wheel's ``libcudart.so.12`` on the
  library path.

Each round runs slices of ``--duration`` seconds in the order A B C C B A, per
operation, so drift on the machine weighs on every implementation alike; after each
slice one more batch, into zeroed blocks, is checked byte for byte. GB/s are medians
over ``--rounds`` rounds, ratios the medians of the ratios within each round.
``--json`` prints one JSON object last.
"""

import argparse
import ctypes
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import queue
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAKE_LIBCUDA = ROOT / "crates" / "te-python" / "tests" / "fakecuda" / "fake_libcuda.c"
IMPLS = ("te.mooncake", "native", "mooncake")
OPS = ("write", "read")


def emit(obj):
    print(json.dumps(obj), flush=True)


def pattern(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def block_of(data, i, block):
    """Block ``i`` of ``data``."""
    return data[int(i) * block : (int(i) + 1) * block]


def batches(args):
    """``--batches`` draws of ``(target blocks, initiator blocks)``, ``--blocks`` each,
    distinct within a draw, from each pool's half (see ``Layout``)."""
    rng = np.random.default_rng(args.seed)
    half = args.pool // 2
    return [(rng.choice(half, args.blocks, replace=False),
             rng.choice(half, args.blocks, replace=False)) for _ in range(args.batches)]


class Layout:
    """Where the blocks of a pool of ``--pool`` blocks at ``base`` are: its first half
    is seeded (read by peers, or the source of writes), its second half is where
    transfers land."""

    def __init__(self, args, base):
        self.block = args.block_size
        self.half = args.pool // 2 * args.block_size
        self.base = base

    def source(self, i):
        return self.base + int(i) * self.block

    def dest(self, i):
        return self.base + self.half + int(i) * self.block


class Pool(Layout):
    """This process's pool: the first half seeded with ``pattern(seed)``."""

    def __init__(self, args, seed):
        self.buf = np.zeros(args.pool * args.block_size, np.uint8)
        super().__init__(args, self.buf.ctypes.data)
        self.buf[: self.half] = pattern(seed, self.half)

    def dest_block(self, i):
        return block_of(self.buf[self.half :], i, self.block)


def load(impl):
    if impl == "mooncake":
        import mooncake.engine as m
    else:
        import te.mooncake as m
    return m


def target(args):
    m = load(args.impl)
    e = m.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    pools = Pool(args, args.seed + 1)
    assert e.register_memory(pools.base, pools.buf.nbytes) == 0
    emit({"session": f"127.0.0.1:{e.get_rpc_port()}", "base": pools.base})
    initiator_pattern = pattern(args.seed + 2, pools.half)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd[0] == "check":  # [target dest blocks, initiator source blocks] of a WRITE
            ok = all(np.array_equal(pools.dest_block(t),
                                    block_of(initiator_pattern, s, pools.block))
                     for t, s in zip(cmd[1], cmd[2]))
            for t in cmd[1]:
                pools.dest_block(t)[:] = 0
            emit({"ok": ok})
        elif cmd[0] == "quit":
            return


def initiator(args):
    hs = json.loads(sys.stdin.readline())
    m = load(args.impl)
    e = m.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    pools = Pool(args, args.seed + 2)
    assert e.register_memory(pools.base, pools.buf.nbytes) == 0
    session, remote = hs["session"], Layout(args, hs["base"])
    draws = batches(args)
    lens = [args.block_size] * args.blocks
    # Mooncake's form: addresses in lists, per batch and operation.
    calls = {
        "write": [([pools.source(s) for s in sb], [remote.dest(t) for t in tb])
                  for tb, sb in draws],
        "read": [([pools.dest(s) for s in sb], [remote.source(t) for t in tb])
                 for tb, sb in draws],
    }
    native = None
    if args.impl == "te.mooncake":
        # te's native API on the same engine: its own registration of the same memory,
        # the target's region found in the peer's descriptor.
        engine = e.get_engine()
        reg = engine.register(pools.base, pools.buf.nbytes)
        peer = engine.connect(session)
        region = next(r for r in peer.regions()
                      if r["addr"] <= remote.base < r["addr"] + r["len"])
        off = remote.base - region["addr"]
        native = {"engine": engine, "peer": peer, "reg": reg, "arrays": {}}
        for op in OPS:
            arrays = []
            for tb, sb in draws:
                a = np.empty((args.blocks, 5), np.uint64)
                a[:, 0] = reg.id
                a[:, 2] = region["id"]
                a[:, 4] = args.block_size
                if op == "write":
                    a[:, 1] = sb * args.block_size
                    a[:, 3] = off + remote.half + tb * args.block_size
                else:
                    a[:, 1] = pools.half + sb * args.block_size
                    a[:, 3] = off + tb * args.block_size
                arrays.append(a)
            native["arrays"][op] = arrays
    target_pattern = pattern(args.seed + 1, pools.half)
    emit({"ready": True})

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd[0] == "quit":
            return
        impl, op, seconds = cmd
        if impl == "native":
            arrays, eng, peer = native["arrays"][op], native["engine"], native["peer"]

            def call(i):
                eng.transfer(peer, arrays[i], op).wait()  # raises if the batch failed
                return 0
        else:
            f = e.batch_transfer_sync_write if op == "write" else e.batch_transfer_sync_read
            pairs = calls[op]

            def call(i):
                return f(session, pairs[i][0], pairs[i][1], lens)
        n = 0
        start = time.perf_counter()
        end = start + seconds
        while True:
            i = n % (len(draws) - 1)  # the last draw is kept for the check
            if call(i) != 0:
                emit({"error": f"{impl} {op} batch {n} failed"})
                return
            n += 1
            if time.perf_counter() >= end:
                break
        elapsed = time.perf_counter() - start
        result = {"gbps": n * args.blocks * args.block_size / elapsed / 1e9, "batches": n}
        # The check: one more batch, of a draw no timed batch used, into zeroed blocks
        # (the target zeroes the blocks it checked), so no earlier batch can pass it.
        v = len(draws) - 1
        tb, sb = draws[v]
        if op == "read":
            for s in sb:
                pools.dest_block(s)[:] = 0
        if call(v) != 0:
            emit({"error": f"{impl} {op}: the checked batch failed"})
            return
        if op == "read":
            result["ok"] = all(np.array_equal(pools.dest_block(s),
                                              block_of(target_pattern, t, args.block_size))
                               for t, s in zip(tb, sb))
        else:
            result["check"] = [[int(t) for t in tb], [int(s) for s in sb]]
        emit(result)


class Proc:
    """A child process running this script in a role, spoken to in JSON lines."""

    def __init__(self, role, impl, args, env):
        cmd = [sys.executable, __file__, "--role", role, "--impl", impl] + args.forward
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL if impl == "mooncake" else None,
                                  text=True, env=env)
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.p.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def read(self):
        msg = self.lines.get(timeout=300)
        if msg is None:
            sys.exit(f"a benchmark process exited ({self.p.wait()})")
        if "error" in msg:
            sys.exit(msg["error"])
        return msg

    def send(self, obj):
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def close(self):
        if self.p.poll() is None:
            self.send(["quit"])
            try:
                self.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()


def mooncake_env(tmp):
    """The environment Mooncake's wheel loads in: ``libcudart.so.12`` from the
    nvidia-cuda-runtime-cu12 wheel and, without NVIDIA's driver, the stand-in
    ``libcuda.so.1``."""
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is None or importlib.util.find_spec("mooncake") is None:
        sys.exit("pip install mooncake-transfer-engine nvidia-cuda-runtime-cu12")
    path = [str(pathlib.Path(next(iter(spec.submodule_search_locations))) / "lib")]
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        subprocess.run(["cc", "-shared", "-fPIC", "-o", f"{tmp}/libcuda.so.1", str(FAKE_LIBCUDA)],
                       check=True)
        path.insert(0, tmp)
    if os.environ.get("LD_LIBRARY_PATH"):
        path.append(os.environ["LD_LIBRARY_PATH"])
    return dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(path))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=64, help="blocks per batch (64)")
    ap.add_argument("--block-size", type=int, default=32 << 10, help="bytes per block (32 KiB)")
    ap.add_argument("--pool", type=int, default=2048, help="blocks in each process's pool (2048)")
    ap.add_argument("--batches", type=int, default=256, help="distinct random batches (256)")
    ap.add_argument("--duration", type=float, default=2.0, help="seconds per slice (2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, medians reported (3)")
    ap.add_argument("--seed", type=int, default=20261126)
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--role", choices=("target", "initiator"), help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=("te.mooncake", "mooncake"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pool < 2 * args.blocks:
        ap.error("--pool must hold at least twice --blocks")
    if args.role:
        return {"target": target, "initiator": initiator}[args.role](args)
    args.forward = [f"--blocks={args.blocks}", f"--block-size={args.block_size}",
                    f"--pool={args.pool}", f"--batches={args.batches}", f"--seed={args.seed}"]

    with tempfile.TemporaryDirectory() as tmp:
        envs = {"te.mooncake": dict(os.environ), "mooncake": mooncake_env(tmp)}
        pairs = {}
        try:
            for impl, env in envs.items():
                t = Proc("target", impl, args, env)
                i = Proc("initiator", impl, args, env)
                i.send(t.read())
                i.read()
                pairs[impl] = (t, i)
            order = ["te.mooncake", "native", "mooncake"]
            rounds = []
            for _ in range(args.rounds):
                got = {op: {impl: [] for impl in IMPLS} for op in OPS}
                for op in OPS:
                    for impl in order + order[::-1]:
                        t, i = pairs["mooncake" if impl == "mooncake" else "te.mooncake"]
                        i.send([impl, op, args.duration])
                        res = i.read()
                        if op == "write":
                            t.send(["check"] + res["check"])
                            res["ok"] = t.read()["ok"]
                        if not res["ok"]:
                            sys.exit(f"{impl} {op}: the last batch's bytes are wrong")
                        got[op][impl].append(res["gbps"])
                rounds.append({op: {impl: statistics.mean(v) for impl, v in got[op].items()}
                               for op in OPS})
        finally:
            for t, i in pairs.values():
                i.close()
                t.close()

    gbps = {op: {impl: statistics.median(r[op][impl] for r in rounds) for impl in IMPLS}
            for op in OPS}
    ratios = {op: {
        "te.mooncake / mooncake": statistics.median(
            r[op]["te.mooncake"] / r[op]["mooncake"] for r in rounds),
        "te.mooncake / native": statistics.median(
            r[op]["te.mooncake"] / r[op]["native"] for r in rounds),
    } for op in OPS}
    print(f"{args.blocks} x {args.block_size // 1024} KiB random blocks per batch, "
          f"{args.rounds} rounds of {args.duration:g} s slices")
    for op in OPS:
        cols = "  ".join(f"{impl} {gbps[op][impl]:6.2f} GB/s" for impl in IMPLS)
        rats = "  ".join(f"{k} {v:.2f}" for k, v in ratios[op].items())
        print(f"{op:5}  {cols}  |  {rats}")
    if args.json:
        print(json.dumps({"gb_per_s": gbps, "ratios": ratios, "rounds": rounds}))


if __name__ == "__main__":
    main()
