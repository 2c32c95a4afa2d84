"""A KV-cache pull, as vLLM's NixlConnector does it, for differential tests.

Run as ``python kv_pull.py ROLE IMPL`` with ROLE ``target`` (the prefill side: owns
the blocks, is read from, receives notifications) or ``initiator`` (the decode side:
reads blocks, notifies), and IMPL ``te`` (``te.nixl``) or ``nixl`` (NIXL's package).
The same code runs against either; every call's observable result — return values,
exceptions (class and NIXL status), bytes moved, telemetry counts, notifications —
is printed as one JSON line for the test to compare.

The target prints its handshake (metadata in hex, region addresses) and then
answers commands on stdin, one per line:

- ``notifs N``: waits (up to 20 s) until N notifications arrived; prints them.
- ``watch MSG``: waits for notification MSG, then at once overwrites the big region
  (as a prefill frees blocks a READ's notification says were read); prints them.
- ``sha``: prints the SHA-256 of each small region.

The initiator reads the handshake from stdin, runs its scenario and prints its
results; between the steps that need the target it prints ``ready STEP`` and waits
for a line on stdin.
"""

import hashlib
import importlib
import json
import os
import sys
import time

import numpy as np

BLOCK = 16 << 10
BLOCKS = 64
REGIONS = 2
BIG_BLOCK = 256 << 10
BIG_BLOCKS = 64
SEED = 20261126


def load(impl):
    """NIXL's agent classes from ``te.nixl`` or from ``nixl``."""
    pkg = {"te": "te.nixl", "nixl": "nixl"}[impl]
    api = importlib.import_module(pkg + "._api")
    importlib.import_module(pkg + "._bindings")
    return api.nixl_agent, api.nixl_agent_config


def pattern(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def out(obj):
    print(json.dumps(obj), flush=True)


def outcome(f):
    """A call's observable result: its return value, or the exception's class name and
    NIXL status (the message's first word for NIXL's own exceptions)."""
    try:
        r = f()
    except Exception as e:  # noqa: BLE001 (the exception is the result)
        status = str(e).split(":")[0] if type(e).__name__.startswith("nixl") else ""
        return {"raises": type(e).__name__, "status": status}
    if isinstance(r, bytes):
        return {"bytes": r.decode("latin-1")}
    if r is None or isinstance(r, (str, int, bool)):
        return {"value": r}
    return {"type": type(r).__name__}


def wait_done(agent, handle, timeout=20.0):
    """Polls ``check_xfer_state`` (NIXL has no blocking wait) until not ``PROC``."""
    end = time.monotonic() + timeout
    while True:
        state = agent.check_xfer_state(handle)
        if state != "PROC" or time.monotonic() > end:
            return state
        time.sleep(0.0005)


def target(impl):
    nixl_agent, nixl_agent_config = load(impl)
    agent = nixl_agent("prefill", nixl_agent_config(backends=["UCX"]))
    small = [pattern(SEED + r, BLOCK * BLOCKS) for r in range(REGIONS)]
    big = pattern(SEED + 100, BIG_BLOCK * BIG_BLOCKS)
    # Registered as vLLM does: (address, length, device id, metadata) tuples.
    caches = [(a.ctypes.data, a.nbytes, 0, "") for a in small + [big]]
    descs = agent.get_reg_descs(caches, "DRAM")
    agent.register_memory(descs, backends=["UCX"])
    out({
        "metadata": agent.get_agent_metadata().hex(),
        "small": [a.ctypes.data for a in small],
        "big": big.ctypes.data,
    })
    seen = {}

    def drain():
        for name, msgs in agent.get_new_notifs().items():
            seen.setdefault(name, []).extend(m.decode("latin-1") for m in msgs)

    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "notifs":
            end = time.monotonic() + 20
            while sum(map(len, seen.values())) < int(arg) and time.monotonic() < end:
                drain()
                time.sleep(0.001)
            out(seen)
            seen = {}
        elif cmd == "watch":
            end = time.monotonic() + 20
            while arg not in seen.get("decode", []) and time.monotonic() < end:
                drain()
                time.sleep(0.0001)
            big[:] = 0  # the blocks are free once the READ's notification arrived
            out(seen)
            seen = {}
        elif cmd == "sha":
            out([hashlib.sha256(a).hexdigest() for a in small])
        elif cmd == "quit":
            break
    agent.deregister_memory(descs)


def initiator(impl):
    nixl_agent, nixl_agent_config = load(impl)
    hs = json.loads(sys.stdin.readline())
    agent = nixl_agent("decode", nixl_agent_config(capture_telemetry=True))
    res = {}
    rng = np.random.default_rng(7)

    local = [np.zeros(BLOCK * BLOCKS, np.uint8) for _ in range(REGIONS)]
    big = np.zeros(BIG_BLOCK * BIG_BLOCKS, np.uint8)
    # Registered as an N×3 uint64 array (address, length, device id).
    rows = np.array([[a.ctypes.data, a.nbytes, 0] for a in local + [big]], np.uint64)
    reg = agent.register_memory(rows, "DRAM")

    md = bytes.fromhex(hs["metadata"])
    res["add_remote_agent"] = outcome(lambda: agent.add_remote_agent(md))
    remote = agent.add_remote_agent(md)

    # One descriptor per (region, block), region-major, as vLLM numbers them.
    def block_descs(bases):
        return [(b + i * BLOCK, BLOCK, 0) for b in bases for i in range(BLOCKS)]

    local_descs = np.array(block_descs([a.ctypes.data for a in local]), np.uint64)
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(local_descs, "DRAM"))
    remote_h = agent.prep_xfer_dlist(remote, block_descs(hs["small"]), "DRAM")

    expected = [pattern(SEED + r, BLOCK * BLOCKS).reshape(BLOCKS, BLOCK) for r in range(REGIONS)]

    def check(local_ids, remote_ids):
        """Every byte of each local descriptor equals its remote descriptor's."""
        for li, ri in zip(local_ids.tolist(), remote_ids.tolist()):
            got = local[li // BLOCKS].reshape(BLOCKS, BLOCK)[li % BLOCKS]
            if not np.array_equal(got, expected[ri // BLOCKS][ri % BLOCKS]):
                return False
        return True

    def read(name, local_ids, remote_ids, notif, repost=None, late=0.0):
        h = agent.make_prepped_xfer("READ", local_h, local_ids, remote_h, remote_ids,
                                    notif_msg=notif)
        posted = agent.transfer(h)
        time.sleep(late)  # the agent first looks at the transfer this much later
        state = wait_done(agent, h)
        tel = agent.get_xfer_telemetry(h)
        res[name] = {
            "posted": posted in ("PROC", "DONE"),
            "state": state,
            "bytes_ok": check(local_ids, remote_ids),
            "totalBytes": tel.totalBytes,
            "descCount": tel.descCount,
            "times_ok": tel.xferDuration > 0 and tel.postDuration >= 0 and tel.startTime > 0,
            # NIXL's duration ends when the agent sees the completion (unless the
            # transfer was already complete when posting it returned).
            "duration_covers_late_look": posted == "DONE" or tel.xferDuration >= late * 1e6,
        }
        if repost is not None:
            # A completed request posted again, with a new notification.
            for a in local:
                a[:] = 0
            agent.transfer(h, repost)
            res[name]["repost_state"] = wait_done(agent, h)
            res[name]["repost_bytes_ok"] = check(local_ids, remote_ids)
        agent.release_xfer_handle(h)

    n = REGIONS * BLOCKS
    # Scattered blocks, both sides permuted: 64 descriptors, none adjacent to the next.
    perm_l = rng.permutation(n)[:64].astype(np.int64)
    perm_r = rng.permutation(n)[:64].astype(np.int64)
    read("read_scattered", perm_l, perm_r, b"read-1")
    # A run of consecutive blocks on both sides: NIXL merges it into one descriptor.
    run = np.arange(10, 30, dtype=np.int64)
    read("read_run", run, run + BLOCKS, b"read-2", repost=b"read-3", late=0.1)
    res["no_notifs"] = agent.get_new_notifs()

    out({"ready": "notifs"})
    sys.stdin.readline()

    # Standalone notifications, in order, str and bytes.
    for i in range(4):
        agent.send_notif(remote, f"n-{i}" if i % 2 else f"n-{i}".encode())
    out({"ready": "notifs"})
    sys.stdin.readline()

    # A WRITE of four blocks into the target's second region, with a notification.
    src = pattern(99, 4 * BLOCK)
    local[0][: 4 * BLOCK] = src
    h = agent.make_prepped_xfer("WRITE", local_h, np.arange(4), remote_h,
                                np.arange(BLOCKS, BLOCKS + 4), notif_msg=b"write-1")
    res["write_post"] = outcome(lambda: agent.transfer(h) in ("PROC", "DONE"))
    res["write_state"] = wait_done(agent, h)
    agent.release_xfer_handle(h)
    expected[1][:4] = src.reshape(4, BLOCK)
    res["write_expected_sha"] = [hashlib.sha256(e).hexdigest() for e in expected]
    out({"ready": "sha"})
    sys.stdin.readline()

    # A big READ whose notification the target answers by overwriting the blocks:
    # the data read must be the original, so the notification came after the read.
    big_local = agent.prep_xfer_dlist("", [(big.ctypes.data + i * BIG_BLOCK, BIG_BLOCK, 0)
                                           for i in range(BIG_BLOCKS)], "DRAM")
    big_remote = agent.prep_xfer_dlist(remote, [(hs["big"] + i * BIG_BLOCK, BIG_BLOCK, 0)
                                                for i in range(BIG_BLOCKS)], "DRAM")
    order = np.arange(BIG_BLOCKS, dtype=np.int64)[::-1].copy()
    out({"ready": "watch big-read"})
    sys.stdin.readline()
    h = agent.make_prepped_xfer("READ", big_local, order, big_remote, order,
                                notif_msg=b"big-read")
    agent.transfer(h)
    res["big_state"] = wait_done(agent, h)
    res["big_bytes_ok"] = bool(np.array_equal(big, pattern(SEED + 100, big.nbytes)))
    agent.release_xfer_handle(h)

    # Bad input: each call's exception class and status.
    small0 = hs["small"][0]
    bad = {
        "prep_remote_outside": lambda: agent.prep_xfer_dlist(
            remote, [(small0 + BLOCK * BLOCKS, BLOCK, 0)], "DRAM"),
        "prep_remote_straddling": lambda: agent.prep_xfer_dlist(
            remote, [(small0 + BLOCK * BLOCKS - 8, BLOCK, 0)], "DRAM"),
        "prep_remote_wrong_device": lambda: agent.prep_xfer_dlist(
            remote, [(small0, BLOCK, 1)], "DRAM"),
        "prep_local_unregistered": lambda: agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", [(src.ctypes.data, BLOCK, 0)], "DRAM"),
        "prep_unknown_agent": lambda: agent.prep_xfer_dlist(
            "nobody", [(small0, BLOCK, 0)], "DRAM"),
        "prep_no_mem_type": lambda: agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(small0, 1, 0)]),
        "prep_empty": lambda: agent.prep_xfer_dlist("NIXL_INIT_AGENT", [], "DRAM"),
        "xfer_descs_no_mem_type": lambda: agent.get_xfer_descs([(small0, 1, 0)]),
        "xfer_descs_4_tuples": lambda: agent.get_xfer_descs([(small0, 1, 0, "")], "DRAM"),
        "reg_descs_3_tuples": lambda: agent.get_reg_descs([(small0, 1, 0)], "DRAM"),
        "unknown_mem_type": lambda: agent.get_xfer_descs([(small0, 1, 0)], "HBM"),
        "index_out_of_range": lambda: agent.make_prepped_xfer(
            "READ", local_h, [n], remote_h, [0]),
        "negative_index": lambda: agent.make_prepped_xfer("READ", local_h, [-1], remote_h, [0]),
        "index_counts_differ": lambda: agent.make_prepped_xfer(
            "READ", local_h, [0, 1], remote_h, [0]),
        "no_indices": lambda: agent.make_prepped_xfer("READ", local_h, [], remote_h, []),
        "bad_operation": lambda: agent.make_prepped_xfer("MOVE", local_h, [0], remote_h, [0]),
        "sides_swapped": lambda: agent.make_prepped_xfer("READ", remote_h, [0], local_h, [0]),
        "length_mismatch": lambda: agent.make_prepped_xfer(
            "READ", big_local, [0], remote_h, [0]),
        "notif_unknown_agent": lambda: agent.send_notif("nobody", b"x"),
        "garbage_metadata": lambda: agent.add_remote_agent(b"not metadata"),
        "own_metadata": lambda: agent.add_remote_agent(agent.get_agent_metadata()),
        "remove_unknown_agent": lambda: agent.remove_remote_agent("nobody"),
        "deregister_unregistered": lambda: agent.deregister_memory(
            agent.get_reg_descs([(src.ctypes.data, 64, 0, "")], "DRAM")),
    }
    res["bad"] = {k: outcome(f) for k, f in bad.items()}
    fresh = agent.make_prepped_xfer("READ", local_h, [0], remote_h, [0])
    res["bad"]["check_before_post"] = outcome(lambda: agent.check_xfer_state(fresh))
    res["bad"]["telemetry_before_post"] = outcome(lambda: agent.get_xfer_telemetry(fresh))
    agent.release_xfer_handle(fresh)

    agent.remove_remote_agent(remote)
    res["bad"]["make_after_remove"] = outcome(
        lambda: agent.make_prepped_xfer("READ", local_h, [0], remote_h, [0]))
    res["bad"]["prep_after_remove"] = outcome(
        lambda: agent.prep_xfer_dlist(remote, [(small0, BLOCK, 0)], "DRAM"))
    agent.release_dlist_handle(local_h)
    agent.release_dlist_handle(remote_h)
    agent.deregister_memory(reg)
    res["deregistered_twice"] = outcome(lambda: agent.deregister_memory(reg))
    out({"results": res})


if __name__ == "__main__":
    role, impl = sys.argv[1], sys.argv[2]
    {"target": target, "initiator": initiator}[role](impl)
    if impl == "nixl":
        # NIXL 1.5.1 crashes (SIGSEGV) in its teardown at interpreter exit once its
        # peer has gone; its results are out, so leave without running destructors.
        sys.stdout.flush()
        os._exit(0)
