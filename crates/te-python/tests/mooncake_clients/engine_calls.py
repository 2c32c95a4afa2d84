"""Every TransferEngine call the frameworks make, with its error cases, for the
differential test: ``python engine_calls.py ROLE IMPL``.

ROLE ``target`` registers two regions of one buffer (the upper one first), prints its
handshake and answers commands on stdin, one JSON list per line:

- ``["notifies", N]``: waits for N notifications; prints them with the SHA-256 of the
  buffer as it was when the last one arrived.
- ``["sha"]``: prints the buffer's SHA-256.
- ``["quit"]``: exits (the test then answers the initiator itself).

ROLE ``initiator`` reads the handshake from stdin and runs its calls; where it needs
the target it prints ``{"ask": COMMAND}`` and reads the answer from stdin. It prints
``{"results": {...}}`` last: every call's return value or exception class, whether
the bytes moved are the ones expected, the notifications the target saw. The test
runs it with te.mooncake and with Mooncake's wheel and compares the results.
"""

import hashlib
import json
import sys
import time

import numpy as np

from common import load, out, outcome, pattern, read, wait_notifies

REGION = 4 << 20  # each of the target's two regions
BLOCK = 4096
SEED = 20261126


def target(m):
    e = m.TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.zeros(2 * REGION, np.uint8)
    buf[:REGION] = pattern(SEED, REGION)
    low, high = buf.ctypes.data, buf.ctypes.data + REGION
    assert e.register_memory(high, REGION) == 0
    assert e.register_memory(low, REGION) == 0
    out({"session": f"127.0.0.1:{e.get_rpc_port()}", "low": low, "high": high})
    while (cmd := read()) is not None:
        if cmd[0] == "notifies":
            got = wait_notifies(e, cmd[1])
            out({"notifies": got, "sha": hashlib.sha256(buf).hexdigest()})
        elif cmd[0] == "sha":
            out({"sha": hashlib.sha256(buf).hexdigest()})
        elif cmd[0] == "quit":
            break


def module_surface(m):
    """What the module exports: opcodes, notifications, build flags."""
    n = m.TransferNotify("n", "m")
    empty = m.TransferNotify()
    flags = [k for k in dir(m) if k.startswith("SUPPORT_")]
    return {
        "opcodes": {k: int(v) for k, v in m.TransferOpcode.__members__.items()},
        "module_opcodes": [m.Read is m.TransferOpcode.Read, m.Write is m.TransferOpcode.Write],
        "class_opcode": m.TransferEngine.TransferOpcode is m.TransferOpcode,
        "notify": [n.name, n.msg, empty.name, empty.msg],
        "flags": sorted(flags),
        "flag_types": sorted({type(getattr(m, k)).__name__ for k in flags}),
    }


def registrations(m, e):
    """Return codes of registration, its error cases and a second initialize."""
    buf = np.zeros(1 << 20, np.uint8)
    a = buf.ctypes.data
    r = {}
    r["register"] = e.register_memory(a, 4096)
    r["same_again"] = e.register_memory(a, 4096)
    r["longer"] = e.register_memory(a, 8192)
    r["inside"] = e.register_memory(a + 100, 100)
    r["overlap_tail"] = e.register_memory(a + 2048, 4096)
    r["adjacent"] = e.register_memory(a + 4096, 4096)
    r["zero_length"] = e.register_memory(a + 65536, 0)
    r["batch_with_zero"] = e.batch_register_memory([a + 100000, a + 200000], [4096, 0])
    r["after_batch_with_zero"] = e.register_memory(a + 100000, 4096)
    r["batch_overlapping_itself"] = e.batch_register_memory([a + 300000, a + 300100], [4096, 100])
    r["after_batch_overlap"] = e.register_memory(a + 300000, 4096)
    r["batch_overlapping_old"] = e.batch_register_memory([a + 500000, a + 100000], [4096, 100])
    r["after_batch_overlapping_old"] = e.register_memory(a + 500000, 4096)
    r["batch_extra_capacity"] = e.batch_register_memory([a + 600000], [4096, 10])
    r["batch_location_kw"] = e.batch_register_memory([a + 700000], [4096], location="cpu:0")
    r["location_cpu"] = e.register_memory(a + 710000, 4096, "cpu:0")
    r["location_wildcard"] = e.register_memory(a + 720000, 4096, location="*")
    r["batch_empty"] = [e.batch_register_memory([], []), e.batch_unregister_memory([])]
    r["unregister_unknown"] = e.unregister_memory(a + 12345)
    r["unregister_inside"] = e.unregister_memory(a + 100001)
    r["batch_unregister_partial"] = e.batch_unregister_memory([a + 100000, a + 777])
    r["after_batch_unregister_partial"] = e.register_memory(a + 100000, 4096)
    r["unregister"] = e.unregister_memory(a)
    r["unregister_again"] = e.unregister_memory(a)
    r["reregister"] = e.register_memory(a, 4096)
    r["negative_length"] = outcome(lambda: e.register_memory(a + 800000, -1))
    r["str_address"] = outcome(lambda: e.register_memory("a", 16))
    r["none_location"] = outcome(lambda: e.register_memory(a + 800000, 16, None))
    port = e.get_rpc_port()
    r["second_initialize"] = e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    r["second_initialize_new_port"] = e.get_rpc_port() != port
    r["unregister_after_second_initialize"] = e.unregister_memory(a)
    r["register_after_second_initialize"] = e.register_memory(a, 4096)
    r["unregister_last"] = e.unregister_memory(a)
    mb = e.allocate_managed_buffer(4096)
    r["managed"] = [mb != 0, e.write_bytes_to_buffer(mb, b"hello te", 8),
                    e.read_bytes_from_buffer(mb, 8).hex(), e.free_managed_buffer(mb, 4096)]
    return r


def local_calls(m, e):
    """Calls that need no live peer."""
    x = np.zeros(64, np.uint8).ctypes.data
    return {
        "probe_unresolvable": e.send_probe("no-such-host.invalid:1234"),
        "probe_dead": e.send_probe("127.0.0.1:1"),
        "warmup_efa": e.warmup_efa_segment("127.0.0.1:1"),
        "engine_ptr_is_int": isinstance(e.get_engine_ptr(), int),
        "topology": json.loads(e.get_local_topology()),
        "write_on_cuda": outcome(lambda: e.transfer_write_on_cuda("127.0.0.1:1", x, x, 16)),
        "read_on_cuda": outcome(lambda: e.transfer_read_on_cuda("127.0.0.1:1", x, x, 16)),
        "batch_write_on_cuda": outcome(
            lambda: e.batch_transfer_write_on_cuda("127.0.0.1:1", [x], [x], [16])),
        "batch_read_on_cuda": outcome(
            lambda: e.batch_transfer_read_on_cuda("127.0.0.1:1", [x], [x], [16])),
        "first_buffer_of_dead_peer": e.get_first_buffer_address("127.0.0.1:1"),
        "sync_to_dead_peer": e.transfer_sync_write("127.0.0.1:1", x, x, 16),
        "async_to_dead_peer": e.batch_transfer_async_write("127.0.0.1:1", [x], [x], [16]),
        "submit_to_dead_peer": e.transfer_submit_write("127.0.0.1:1", x, x, 16),
    }


def failed_batch(e, batch_id):
    """A failed async batch, whichever way it failed: Mooncake checks peer addresses
    when it moves the data (a batch id, then status -1), te when it submits (0)."""
    return batch_id == 0 or e.get_batch_transfer_status([batch_id]) < 0


def transfers(m, e, hs, mine, back):
    """Transfers against the live target, every byte checked; ``mine`` holds
    ``pattern(SEED + 1)``, ``back`` zeros. Returns the results and the bytes the
    target's buffer should hold."""
    s, low, high = hs["session"], hs["low"], hs["high"]
    remote = pattern(SEED, REGION)  # the target's low region
    r = {"probe_live": e.send_probe(s),
         "register": e.batch_register_memory([mine.ctypes.data, back.ctypes.data], [REGION] * 2)}
    src, dst = mine.ctypes.data, back.ctypes.data

    # Scattered blocks, read: 64 blocks of the target's low region, in random order.
    rng = np.random.default_rng(SEED + 2)
    blocks = rng.permutation(REGION // BLOCK)[:64]
    r["batch_read"] = e.batch_transfer_sync_read(
        s, [dst + i * BLOCK for i in range(64)], [low + int(b) * BLOCK for b in blocks],
        [BLOCK] * 64)
    r["batch_read_bytes"] = bool(np.array_equal(
        back[: 64 * BLOCK].reshape(64, BLOCK), remote.reshape(-1, BLOCK)[blocks]))

    # Scattered blocks, written into the target's high region (which starts zeroed).
    expected = np.zeros(2 * REGION, np.uint8)
    expected[:REGION] = remote
    r["batch_write"] = e.batch_transfer_sync_write(
        s, [src + int(b) * BLOCK for b in blocks], [high + i * BLOCK for i in range(64)],
        [BLOCK] * 64)
    expected[REGION : REGION + 64 * BLOCK] = mine.reshape(-1, BLOCK)[blocks].reshape(-1)

    r["sync_write_hint"] = e.transfer_sync_write(s, src, high + REGION - BLOCK, BLOCK,
                                                 transport_hint="tcp")
    expected[2 * REGION - BLOCK :] = mine[:BLOCK]
    r["sync_read_hint"] = e.transfer_sync_read(s, dst, high, BLOCK, "")
    r["sync_read_bytes"] = bool(np.array_equal(back[:BLOCK], expected[REGION : REGION + BLOCK]))
    r["sync_write_opcode"] = e.transfer_sync(s, src + BLOCK, high + 100 * BLOCK, 100,
                                             m.TransferOpcode.Write)
    expected[REGION + 100 * BLOCK : REGION + 100 * BLOCK + 100] = mine[BLOCK : BLOCK + 100]

    # Zero-length entries move nothing and fail nothing; an empty batch succeeds.
    r["zero_length_entries"] = e.batch_transfer_sync_write(
        s, [src, src + 200, src + 400], [high + 200 * BLOCK, high, high + 201 * BLOCK], [16, 0, 16])
    expected[REGION + 200 * BLOCK : REGION + 200 * BLOCK + 16] = mine[:16]
    expected[REGION + 201 * BLOCK : REGION + 201 * BLOCK + 16] = mine[400:416]
    r["zero_length_single"] = e.transfer_sync_write(s, src, high, 0)
    r["empty_batch"] = e.batch_transfer_sync_write(s, [], [], [])
    r["mismatched_lists"] = e.batch_transfer_sync_write(s, [src], [high, high], [16])
    r["mismatched_async"] = e.batch_transfer_async_write(s, [src], [high, high], [16])

    # Outside the target's regions: fails, writes nothing.
    end = high + REGION
    r["past_the_end"] = e.transfer_sync_write(s, src, end, 16)
    r["straddling_the_end"] = e.transfer_sync_write(s, src, end - 8, 16)
    r["below_the_start"] = e.transfer_sync_write(s, src, low - 4096, 16)
    r["async_past_the_end"] = failed_batch(e, e.batch_transfer_async_write(s, [src], [end], [16]))

    # Bad arguments raise as pybind11 does.
    r["int_opcode"] = outcome(lambda: e.transfer_sync(s, src, high, 16, 1))
    r["str_buffer"] = outcome(lambda: e.transfer_sync_write(s, "buffer", high, 16))
    r["negative_length"] = outcome(lambda: e.transfer_sync_write(s, src, high, -1))
    r["address_over_64_bits"] = outcome(lambda: e.transfer_sync_write(s, src, 2**64, 16))
    r["negative_in_list"] = outcome(lambda: e.batch_transfer_sync_write(s, [src], [high], [-1]))
    r["bad_transport_hint_type"] = outcome(
        lambda: e.transfer_sync_write(s, src, high, 16, transport_hint=3))
    r["status_of_str_id"] = outcome(lambda: e.transfer_check_status("1"))
    r["status_of_float_id"] = outcome(lambda: e.transfer_check_status(1.0))
    r["status_of_negative_id"] = outcome(lambda: e.transfer_check_status(-1))
    r["batch_status_of_str_ids"] = outcome(lambda: e.get_batch_transfer_status(["1"]))
    r["batch_status_of_negative_ids"] = outcome(lambda: e.get_batch_transfer_status([-1]))

    # Async batches and their status.
    ids = [
        e.batch_transfer_async_write(s, [src + 300 * BLOCK], [high + 300 * BLOCK], [BLOCK]),
        e.batch_transfer_async_read(s, [dst + BLOCK], [low + BLOCK], [BLOCK]),
        e.batch_transfer_async(s, [src + 301 * BLOCK], [high + 301 * BLOCK], [BLOCK],
                               m.TransferOpcode.Write, transport_hint=""),
    ]
    expected[REGION + 300 * BLOCK : REGION + 302 * BLOCK] = mine[300 * BLOCK : 302 * BLOCK]
    r["async_ids_positive"] = [i > 0 for i in ids]
    r["async_status"] = e.get_batch_transfer_status(ids)
    r["async_read_bytes"] = bool(np.array_equal(back[BLOCK : 2 * BLOCK], remote[BLOCK : 2 * BLOCK]))
    b = e.transfer_submit_write(s, src + 400 * BLOCK, high + 400 * BLOCK, BLOCK)
    expected[REGION + 400 * BLOCK : REGION + 401 * BLOCK] = mine[400 * BLOCK : 401 * BLOCK]
    status, end_at = e.transfer_check_status(b), time.monotonic() + 20
    while status == 0 and time.monotonic() < end_at:
        time.sleep(0.001)
        status = e.transfer_check_status(b)
    r["submit_then_check"] = [b > 0, status]

    r["first_buffer_is_first_registered"] = e.get_first_buffer_address(s) == high
    return r, expected


def notifications(m, e, hs, mine, expected):
    """Transfers carrying notifications (``expected`` is updated with their bytes)."""
    s, low, high = hs["session"], hs["low"], hs["high"]
    src = mine.ctypes.data
    r = {
        "sync_write": e.transfer_sync(s, src, high + 500 * BLOCK, BLOCK, m.TransferOpcode.Write,
                                      m.TransferNotify("req-1", "written")),
        "batch_write": e.batch_transfer_sync(
            s, [src, src + BLOCK], [high + 501 * BLOCK, high + 502 * BLOCK], [BLOCK] * 2,
            m.TransferOpcode.Write, m.TransferNotify("req-2", "two blocks")),
        "batch_read": e.batch_transfer_sync(s, [src + 600 * BLOCK], [low], [16],
                                            m.TransferOpcode.Read,
                                            m.TransferNotify("req-3", "read")),
        "keywords": e.transfer_sync(s, src, high + 503 * BLOCK, 16, opcode=m.Write,
                                    notify=m.TransferNotify(name="req-4", msg="kw")),
        "local_notifies": [[n.name, n.msg] for n in e.get_notifies()],
    }
    expected[REGION + 500 * BLOCK : REGION + 501 * BLOCK] = mine[:BLOCK]
    expected[REGION + 501 * BLOCK : REGION + 503 * BLOCK] = mine[: 2 * BLOCK]
    expected[REGION + 503 * BLOCK : REGION + 503 * BLOCK + 16] = mine[:16]
    return r


def initiator(m):
    hs = read()
    e = m.TransferEngine()
    res = {"surface": module_surface(m),
           "initialize": e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""),
           "port_positive": e.get_rpc_port() > 0}
    res["registrations"] = registrations(m, e)
    res["local"] = local_calls(m, e)
    mine, back = pattern(SEED + 1, REGION), np.zeros(REGION, np.uint8)
    res["transfers"], expected = transfers(m, e, hs, mine, back)
    res["notifications"] = notifications(m, e, hs, mine, expected)
    out({"ask": ["notifies", 4]})
    seen = read()
    res["target_notifies"] = seen["notifies"]
    res["bytes_when_notified"] = seen["sha"] == hashlib.sha256(expected).hexdigest()
    out({"ask": ["notifies", 0]})
    res["target_notifies_drained"] = read()["notifies"]
    out({"ask": ["quit"]})
    read()  # the test answers once the target has exited
    src = mine.ctypes.data
    s, high = hs["session"], hs["high"]
    res["after_peer_exit"] = {
        "probe": e.send_probe(s),
        "sync_write": e.transfer_sync_write(s, src, high, 16),
        "async_write_failed": failed_batch(e, e.batch_transfer_async_write(s, [src], [high], [16])),
        "probe_again": e.send_probe(s),
    }
    out({"results": res})


if __name__ == "__main__":
    role, impl = sys.argv[1], sys.argv[2]
    {"target": target, "initiator": initiator}[role](load(impl))
