"""vLLM's MooncakeConnector, reduced to its TransferEngine calls, for the differential
test: ``python vllm_connector.py ROLE IMPL``.

As in vLLM, the decode worker (ROLE ``target``) and the prefill worker (ROLE
``initiator``) each ``initialize(ip, "P2PHANDSHAKE", "rdma", "")`` (the connector's
default protocol) and register their KV caches with
``batch_register_memory(ptrs, lens)``, no location: one tensor per layer,
``[2, blocks, block_bytes]``, K then V. Decode sends its session and the base address
of each K and V region; prefill turns each request's block ids into transfers (a run
of blocks consecutive on both sides becomes one transfer, as vLLM coalesces them) and
pushes every request with ``batch_transfer_sync_write`` from a pool of threads.

The target prints its handshake, then answers ``["check", REQUESTS]`` with whether
every block it received holds the prefill's bytes and every other block is still
zero, and ``["quit"]`` by exiting. The initiator prints ``{"ask": ...}`` for those and
``{"results": ...}`` last.
"""

import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from common import load, out, pattern, read

LAYERS = 4
BLOCKS = 64
BLOCK_BYTES = 16 << 10
SEED = 7
HOST = "127.0.0.1"  # vLLM's get_ip()
PROTOCOL = "rdma"  # vLLM's default mooncake_protocol


def caches(fill):
    """The KV caches of one worker: per layer ``[2, BLOCKS, BLOCK_BYTES]``, the
    prefill's seeded (layer by layer), the decode's zeroed."""
    shape = (2, BLOCKS, BLOCK_BYTES)
    if fill:
        return [pattern(SEED + i, 2 * BLOCKS * BLOCK_BYTES).reshape(shape) for i in range(LAYERS)]
    return [np.zeros(shape, np.uint8) for _ in range(LAYERS)]


def region_bases(kv):
    """vLLM's ``kv_caches_base_addr``: the K and then the V region of every layer."""
    return [c[i].ctypes.data for c in kv for i in (0, 1)]


def start(m):
    e = m.TransferEngine()
    rc = e.initialize(HOST, "P2PHANDSHAKE", PROTOCOL, "")
    return e, rc


def target(m):
    e, rc = start(m)
    kv = caches(fill=False)
    reg = e.batch_register_memory([c.ctypes.data for c in kv], [c.nbytes for c in kv])
    out({"session": f"{HOST}:{e.get_rpc_port()}", "initialize": rc, "register": reg,
         "base_addrs": region_bases(kv), "block_len": BLOCK_BYTES})
    while (cmd := read()) is not None:
        if cmd[0] == "check":
            expected = caches(fill=False)
            prefill = caches(fill=True)
            for local_ids, remote_ids in cmd[1]:
                for layer in range(LAYERS):
                    expected[layer][:, remote_ids] = prefill[layer][:, local_ids]
            received = [np.array_equal(kv[i], expected[i]) for i in range(LAYERS)]
            touched = {b for _, remote_ids in cmd[1] for b in remote_ids}
            untouched = [b for b in range(BLOCKS) if b not in touched]
            out({"blocks_ok": all(received),
                 "untouched_ok": all(not kv[i][:, untouched].any() for i in range(LAYERS))})
        elif cmd[0] == "quit":
            break


def contiguous_runs(local_ids, remote_ids):
    """vLLM's ``group_concurrent_contiguous``: runs consecutive on both sides."""
    runs = [[[local_ids[0]], [remote_ids[0]]]]
    for lo, re in zip(local_ids[1:], remote_ids[1:]):
        if lo == runs[-1][0][-1] + 1 and re == runs[-1][1][-1] + 1:
            runs[-1][0].append(lo)
            runs[-1][1].append(re)
        else:
            runs.append([[lo], [re]])
    return runs


def transfer_params(local_bases, remote_bases, block_len, local_ids, remote_ids):
    """One request's ``(src_ptrs, dst_ptrs, lengths)`` over every K and V region."""
    src, dst, lengths = [], [], []
    for lb, rb in zip(local_bases, remote_bases):
        for los, res in contiguous_runs(local_ids, remote_ids):
            src.append(lb + los[0] * block_len)
            dst.append(rb + res[0] * block_len)
            lengths.append(block_len * len(los))
    return src, dst, lengths


def requests():
    """Six requests, ``(prefill block ids, decode block ids)``: one run of blocks on the
    prefill side; on the decode side distinct blocks, from five blocks on split in two
    runs (so a request becomes one or two transfers per region)."""
    rng = np.random.default_rng(SEED)
    reqs, cursor = [], 0
    for n in (1, 3, 5, 8, 13, 21):
        first = int(rng.integers(0, BLOCKS - n))
        local = list(range(first, first + n))
        remote = list(range(cursor, cursor + n))
        if n >= 5:
            remote[n // 2 :] = [b + 1 for b in remote[n // 2 :]]
        cursor = remote[-1] + 2
        reqs.append((local, remote))
    return reqs


def initiator(m):
    hs = read()
    e, rc = start(m)
    kv = caches(fill=True)
    reg = e.batch_register_memory([c.ctypes.data for c in kv], [c.nbytes for c in kv])
    session = hs["session"]
    reqs = requests()
    params = [transfer_params(region_bases(kv), hs["base_addrs"], hs["block_len"], lo, re)
              for lo, re in reqs]
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="vllm-mooncake-sender") as pool:
        rcs = list(pool.map(lambda p: e.batch_transfer_sync_write(session, *p), params))
    # A block past the end of the decode's last V region fails (vLLM reports the
    # request's blocks as failed); nothing is written.
    out_of_range = e.batch_transfer_sync_write(
        session, [kv[-1][1].ctypes.data], [hs["base_addrs"][-1] + BLOCKS * hs["block_len"]],
        [hs["block_len"]])
    out({"ask": ["check", reqs]})
    verdict = read()
    out({"ask": ["quit"]})
    read()
    out({"results": {
        "initialize": rc, "register": reg,
        "target": {"initialize": hs["initialize"], "register": hs["register"]},
        "descriptors": [len(p[0]) for p in params],
        "sends": {f"req-{i}": r for i, r in enumerate(rcs)},
        "out_of_range_send": out_of_range,
        **verdict,
    }})


if __name__ == "__main__":
    role, impl = sys.argv[1], sys.argv[2]
    {"target": target, "initiator": initiator}[role](load(impl))
