"""``python -m te.nixl_bench``: block reads through te.nixl, NIXL itself and te's
native API, in one run.

A target process owns ``--pool`` blocks of ``--block-size`` random bytes; an
initiator process READs ``--blocks`` distinct random blocks of it per transfer into
random blocks of its own pool, keeping ``--window`` transfers in flight, each with a
notification. NIXL's API is driven as vLLM's NixlConnector drives it: every transfer
is made (``make_prepped_xfer``), posted, polled with ``check_xfer_state`` (NIXL has
no blocking wait: each step looks at every transfer in flight and sleeps ``--poll``
seconds if none was done), its telemetry read and released. te's native API builds
the same ``N×5`` requests in numpy and waits on the oldest handle (``native``), or
looks at its handles with ``done()`` in the same loop as NIXL's API
(``native-poll``: what te.nixl adds, without what polling costs).

te.nixl and native te run in the same pair of processes, on the same engines,
memory and connection, in alternating slices (A B C C B A, ``--slices`` times per
round), so only the API layer differs between them. NIXL (UCX over TCP on loopback:
``UCX_TLS=tcp``, ``UCX_NET_DEVICES=lo``) runs in its own pair of processes. Each
slice's last transfer is checked byte for byte. ``--repeat N`` runs N rounds and
reports medians; the ratios are medians of the ratios within each round, so a busy
minute on the machine weighs on both sides of a ratio alike.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

IMPLS = ("te.nixl", "nixl", "native", "native-poll")
SEED = 11


def _pattern(n):
    return np.random.default_rng(SEED).integers(0, 256, n, dtype=np.uint8)


def _emit(obj):
    print(json.dumps(obj), flush=True)


def _api(package):
    return __import__(package + "._api", fromlist=["nixl_agent"])


def target(package, args):
    """Owns the pool; prints its handshake; drains notifications (te bounds what it
    keeps unread) until stdin closes."""
    pool = _pattern(args.pool * args.block_size)
    api = _api(package)
    agent = api.nixl_agent("target", api.nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM", backends=["UCX"])
    _emit({"metadata": agent.get_agent_metadata().hex(), "base": pool.ctypes.data})
    stop = threading.Event()

    def drain():
        while not stop.wait(0.01):
            agent.get_new_notifs()

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    sys.stdin.read()
    stop.set()
    t.join()


def _picks(rng, pool, blocks, slot, slots):
    """(local ids, remote ids): ``blocks`` distinct random blocks on each side, the
    local ones inside slot ``slot`` of ``slots`` equal parts of the pool, so
    transfers in flight together never write the same local block."""
    part = pool // slots
    return (slot * part + rng.choice(part, blocks, replace=False).astype(np.int64),
            rng.choice(pool, blocks, replace=False).astype(np.int64))


class Api:
    """One way of issuing the reads: ``start(local ids, remote ids, message)`` → a
    transfer; then either ``wait(transfer)`` blocks until it is done, or
    ``poll(transfer)`` says without blocking whether it is (and cleans it up)."""

    wait = None
    poll = None


def _nixl_api(agent, remote, local, base, args):
    """NIXL's calls, as a connector makes them."""
    bs = args.block_size
    offs = np.arange(args.pool, dtype=np.uint64) * np.uint64(bs)
    rows = np.stack([offs, np.full_like(offs, bs), np.zeros_like(offs)], axis=1)
    lrows, rrows = rows.copy(), rows.copy()
    lrows[:, 0] += np.uint64(local.ctypes.data)
    rrows[:, 0] += np.uint64(base)
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", lrows, "DRAM")
    rh = agent.prep_xfer_dlist(remote, rrows, "DRAM")
    api = Api()

    def start(li, ri, msg):
        h = agent.make_prepped_xfer("READ", lh, li, rh, ri, notif_msg=msg)
        agent.transfer(h)
        return h

    def poll(h):
        if agent.check_xfer_state(h) == "PROC":
            return False
        agent.get_xfer_telemetry(h)
        agent.release_xfer_handle(h)
        return True

    api.start, api.poll = start, poll
    return api


def _native_api(engine, peer, local, base, args, poll=False):
    """te's own calls: register, connect, transfer an N×5 array, wait on the handle
    (or, with ``poll``, look at it with ``done()`` in the connector's loop)."""
    bs = args.block_size
    reg = engine.register_buffer(local, name="bench-local")
    rid = next(r["id"] for r in peer.regions() if r["addr"] <= base < r["addr"] + r["len"])
    api = Api()
    api.registration = reg  # kept while the API is used (collected: deregistered)

    def start(li, ri, msg):
        req = np.empty((len(li), 5), np.uint64)
        req[:, 0] = reg.id
        req[:, 1] = li * bs
        req[:, 2] = rid
        req[:, 3] = ri * bs
        req[:, 4] = bs
        return engine.transfer(peer, req, op="read", notify=msg)

    def wait(h):
        h.wait()

    def look(h):
        if not h.done():
            return False
        h.wait(0)  # raises the batch's error, if any
        return True

    api.start = start
    if poll:
        api.poll = look
    else:
        api.wait = wait
    return api


def _slice(api, args, rng, seconds):
    """Reads for ``seconds``: (bytes, seconds, ids of the last transfer started).
    Each transfer in flight holds one of ``--window`` slots of the local pool until
    it is done, so no two in flight write the same local block."""
    per = args.blocks * args.block_size
    inflight = []  # (transfer, slot)
    free = list(range(args.window))
    moved, n, ids = 0, 0, None
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        while free and time.perf_counter() < end:
            slot = free.pop()
            ids = _picks(rng, args.pool, args.blocks, slot, args.window)
            inflight.append((api.start(*ids, f"t{n}".encode()), slot))
            n += 1
        if not inflight:
            return moved, time.perf_counter() - t0, ids
        if api.wait is not None:
            h, slot = inflight.pop(0)
            api.wait(h)
            done = [slot]
        else:
            done = [slot for h, slot in inflight if api.poll(h)]
            inflight = [(h, slot) for h, slot in inflight if slot not in done]
            if not done:
                time.sleep(args.poll)
        moved += per * len(done)
        free += done


def initiator(package, impls, args):
    """Runs the requested APIs in alternating slices; prints bytes per second of each
    and whether every slice's last transfer read the right bytes."""
    hs = json.loads(sys.stdin.readline())
    local = np.zeros(args.pool * args.block_size, np.uint8)
    api = _api(package)
    agent = api.nixl_agent("initiator", api.nixl_agent_config(capture_telemetry=True))
    agent.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
    remote = agent.add_remote_agent(bytes.fromhex(hs["metadata"]))
    apis = {}
    if package == "nixl":
        apis["nixl"] = _nixl_api(agent, remote, local, hs["base"], args)
    else:
        if "te.nixl" in impls:
            apis["te.nixl"] = _nixl_api(agent, remote, local, hs["base"], args)
        for name in ("native", "native-poll"):
            if name in impls:
                from .nixl import _metadata

                engine = agent.get_engine()
                address = _metadata.decode(bytes.fromhex(hs["metadata"]))["address"]
                peer = engine.connect(address)  # te caches it: te.nixl's connection
                apis[name] = _native_api(engine, peer, local, hs["base"], args,
                                         poll=name == "native-poll")
    names = list(apis)
    order = (names + names[::-1]) * args.slices  # A B C C B A A B C …
    rng = np.random.default_rng(1)
    src = _pattern(args.pool * args.block_size).reshape(args.pool, args.block_size)
    view = local.reshape(args.pool, args.block_size)
    for name in names:
        _slice(apis[name], args, rng, args.warmup)
    totals = {name: [0, 0.0] for name in names}
    ok = True
    for name in order:
        moved, secs, (li, ri) = _slice(apis[name], args, rng, args.duration / (2 * args.slices))
        totals[name][0] += moved
        totals[name][1] += secs
        ok &= bool(np.array_equal(view[li], src[ri]))
    _emit({"bytes_per_s": {k: m / s for k, (m, s) in totals.items()}, "ok": ok})
    if package == "nixl":
        # NIXL 1.5.1 may crash in its teardown at exit; the result is out.
        os._exit(0)


def _child(role, package, impls, args):
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "te.nixl_bench", "--role", role, "--package", package,
           "--block-size", str(args.block_size), "--blocks", str(args.blocks),
           "--pool", str(args.pool), "--window", str(args.window),
           "--duration", str(args.duration), "--warmup", str(args.warmup),
           "--poll", str(args.poll), "--slices", str(args.slices)]
    for i in impls:
        cmd += ["--impl", i]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)


def _json_line(p):
    for line in p.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"te.nixl_bench: a {p.args[4]} process exited ({p.wait()})")


def measure(package, impls, args):
    """``{impl: bytes per second}`` from a target and an initiator process running
    ``package`` (``te.nixl`` or ``nixl``)."""
    tgt = _child("target", package, impls, args)
    ini = _child("initiator", package, impls, args)
    try:
        hs = _json_line(tgt)
        ini.stdin.write(json.dumps(hs) + "\n")
        ini.stdin.flush()
        res = _json_line(ini)
    finally:
        for p in (ini, tgt):
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
        for p in (ini, tgt):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    if not res["ok"]:
        raise SystemExit(f"te.nixl_bench: {package} read wrong bytes")
    return res["bytes_per_s"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m te.nixl_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=32 << 10, help="bytes per block")
    ap.add_argument("--blocks", type=int, default=64, help="blocks per transfer")
    ap.add_argument("--pool", type=int, default=2048, help="blocks on each side")
    ap.add_argument("--window", type=int, default=4, help="transfers in flight")
    ap.add_argument("--duration", type=float, default=3.0,
                    help="seconds measured per implementation and round")
    ap.add_argument("--warmup", type=float, default=0.5, help="seconds before measuring")
    ap.add_argument("--slices", type=int, default=4,
                    help="rounds of slices (A B C C B A) te.nixl and native te alternate in")
    ap.add_argument("--poll", type=float, default=50e-6,
                    help="seconds a NIXL-API step sleeps when no transfer was done")
    ap.add_argument("--repeat", type=int, default=1, help="rounds (medians reported)")
    ap.add_argument("--impl", action="append", choices=IMPLS,
                    help="only these implementations (repeatable; default: all)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--role", choices=("target", "initiator"), help=argparse.SUPPRESS)
    ap.add_argument("--package", choices=("te.nixl", "nixl"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.pool // args.window < args.blocks:
        ap.error("--pool must hold --window slots of --blocks blocks")
    impls = args.impl or list(IMPLS)
    if args.role == "target":
        return target(args.package, args)
    if args.role == "initiator":
        return initiator(args.package, impls, args)
    runs = {i: [] for i in impls}
    groups = [(p, [i for i in impls if (i == "nixl") == (p == "nixl")])
              for p in ("te.nixl", "nixl")]
    groups = [(p, g) for p, g in groups if g]
    for r in range(args.repeat):
        for package, group in groups[r % len(groups):] + groups[:r % len(groups)]:
            for impl, bps in measure(package, group, args).items():
                runs[impl].append(bps)
    med = {i: statistics.median(v) for i, v in runs.items()}
    ratios = {
        f"{a} / {b}": statistics.median(x / y for x, y in zip(runs[a], runs[b]))
        for a, b in (("te.nixl", "nixl"), ("te.nixl", "native"), ("te.nixl", "native-poll"))
        if a in runs and b in runs
    }
    if args.json:
        print(json.dumps({"gb_per_s": {i: v / 1e9 for i, v in med.items()},
                          "runs": {i: [x / 1e9 for x in v] for i, v in runs.items()},
                          "ratios": ratios}))
        return None
    print(f"reads of {args.blocks} x {args.block_size} B random blocks, window "
          f"{args.window}, {args.duration}s x {args.repeat}")
    for i in impls:
        runs_s = ", ".join(f"{x / 1e9:.3f}" for x in runs[i])
        print(f"  {i:8} {med[i] / 1e9:7.3f} GB/s   (runs: {runs_s})")
    for name, r in ratios.items():
        print(f"  {name:17} = {r:.3f}  (median of per-round ratios)")
    return None


if __name__ == "__main__":
    main()
