"""SGLang's Mooncake backend, reduced to its TransferEngine calls, for the
differential test: ``python sglang_backend.py ROLE IMPL``.

As SGLang's ``MooncakeTransferEngine`` does, both sides ``initialize(host,
"P2PHANDSHAKE", "rdma", "")`` (SGLang's default protocol) and are named
``f"{host}:{get_rpc_port()}"``. Each registers its KV pool (one buffer per layer for K
and one for V) with ``batch_register_memory`` and its aux buffer (per-request metadata)
with ``register_memory``; SGLang's registration registry registers a buffer a second
time and relies on Mooncake's ``-7`` to tell it is already registered. The prefill
side (ROLE ``initiator``) probes the decode side with ``send_probe``, pushes a
request's pages (runs of consecutive pages on both sides become one transfer) with
``batch_transfer_sync_write`` and its aux item with ``transfer_sync_write``. Once the
decode side exited, the probe and the transfers fail, as SGLang's failed-session
handling expects.

The target prints its handshake, answers ``["check", PREFILL_PAGES, DECODE_PAGES,
AUX_SLOT]`` with whether its memory holds exactly what was sent, and exits on
``["quit"]``.
"""

import sys

import numpy as np

from common import load, out, pattern, read

LAYERS = 3
PAGES = 32
PAGE_BYTES = 8 << 10
AUX_SLOTS = 8
AUX_BYTES = 256
SEED = 11
HOST = "127.0.0.1"


def pools(fill):
    """K and V buffers per layer (``[PAGES, PAGE_BYTES]``) and the aux buffer
    (``[AUX_SLOTS, AUX_BYTES]``): the prefill's seeded, the decode's zeroed."""
    n = 2 * LAYERS
    if fill:
        kv = [pattern(SEED + i, PAGES * PAGE_BYTES).reshape(PAGES, PAGE_BYTES) for i in range(n)]
        return kv, pattern(SEED + n, AUX_SLOTS * AUX_BYTES).reshape(AUX_SLOTS, AUX_BYTES)
    return ([np.zeros((PAGES, PAGE_BYTES), np.uint8) for _ in range(n)],
            np.zeros((AUX_SLOTS, AUX_BYTES), np.uint8))


def start(m, kv, aux):
    """A started engine with the pools registered, and the codes each call returned."""
    e = m.TransferEngine()
    codes = {"initialize": e.initialize(HOST, "P2PHANDSHAKE", "rdma", "")}
    codes["kv_register"] = e.batch_register_memory([b.ctypes.data for b in kv],
                                                   [b.nbytes for b in kv])
    codes["aux_register"] = e.register_memory(aux.ctypes.data, aux.nbytes)
    # SGLang's registry: a second registration of the same buffer, or of a view into
    # it, is refused with -7 and the buffer counts as registered.
    codes["aux_register_again"] = e.register_memory(aux.ctypes.data, aux.nbytes)
    codes["aux_view_register"] = e.register_memory(aux[1].ctypes.data, AUX_BYTES)
    return e, codes


def target(m):
    kv, aux = pools(fill=False)
    e, codes = start(m, kv, aux)
    out({"session": f"{HOST}:{e.get_rpc_port()}", "codes": codes,
         "kv": [b.ctypes.data for b in kv], "aux": aux.ctypes.data})
    while (cmd := read()) is not None:
        if cmd[0] == "check":
            _, prefill_pages, decode_pages, slot = cmd
            sent_kv, sent_aux = pools(fill=True)
            ok = True
            for mine, theirs in zip(kv, sent_kv):
                expected = np.zeros_like(mine)
                expected[decode_pages] = theirs[prefill_pages]
                ok &= np.array_equal(mine, expected)
            expected_aux = np.zeros_like(aux)
            expected_aux[slot] = sent_aux[slot]
            out({"bytes_ok": bool(ok and np.array_equal(aux, expected_aux))})
        elif cmd[0] == "quit":
            break


def page_transfers(src_bases, dst_bases, prefill_pages, decode_pages):
    """``(src, dst, lengths)`` for the pages of every layer's K and V buffer: runs of
    pages consecutive on both sides as one transfer (SGLang's
    ``group_concurrent_contiguous``)."""
    runs = [[prefill_pages[0], decode_pages[0], 1]]
    for p, d in zip(prefill_pages[1:], decode_pages[1:]):
        if p == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([p, d, 1])
    src, dst, lengths = [], [], []
    for sb, db in zip(src_bases, dst_bases):
        for p, d, n in runs:
            src.append(sb + p * PAGE_BYTES)
            dst.append(db + d * PAGE_BYTES)
            lengths.append(n * PAGE_BYTES)
    return src, dst, lengths


def initiator(m):
    hs = read()
    kv, aux = pools(fill=True)
    e, codes = start(m, kv, aux)
    session = hs["session"]
    prefill_pages = [3, 4, 5, 9, 17, 18, 30]
    decode_pages = [0, 1, 2, 7, 8, 20, 21]
    slot = 5
    pages = page_transfers([b.ctypes.data for b in kv], hs["kv"], prefill_pages, decode_pages)
    res = dict(codes)
    res["target"] = hs["codes"]
    res["session_has_port"] = session.rsplit(":", 1)[1].isdigit()
    res["probe_live"] = e.send_probe(session)
    res["page_descriptors"] = len(pages[0])
    res["pages"] = e.batch_transfer_sync_write(session, *pages)
    res["aux"] = e.transfer_sync_write(session, aux[slot].ctypes.data,
                                       hs["aux"] + slot * AUX_BYTES, AUX_BYTES)
    out({"ask": ["check", prefill_pages, decode_pages, slot]})
    res.update(read())
    out({"ask": ["quit"]})
    read()
    res["probe_after_exit"] = e.send_probe(session)
    res["pages_after_exit"] = e.batch_transfer_sync_write(session, *pages)
    res["aux_after_exit"] = e.transfer_sync_write(session, aux[slot].ctypes.data,
                                                  hs["aux"] + slot * AUX_BYTES, AUX_BYTES)
    res["deregister"] = [e.batch_unregister_memory([b.ctypes.data for b in kv]),
                         e.unregister_memory(aux.ctypes.data)]
    out({"results": res})


if __name__ == "__main__":
    role, impl = sys.argv[1], sys.argv[2]
    {"target": target, "initiator": initiator}[role](load(impl))
