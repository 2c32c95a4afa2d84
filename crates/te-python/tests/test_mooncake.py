"""te.mooncake: Mooncake's TransferEngine calls, across two processes over tcp."""

import hashlib
import time

import numpy as np
import pytest

from te.mooncake import TransferEngine, TransferOpcode

TARGET = """
    import hashlib, sys
    import numpy as np
    from te.mooncake import TransferEngine
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.zeros(1 << 20, np.uint8)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    print(f"127.0.0.1:{e.get_rpc_port()} {buf.ctypes.data}")
    more = None
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "hash":
            print(hashlib.sha256(buf).hexdigest())
        elif cmd == "fill":
            buf[:] = np.arange(buf.nbytes, dtype=np.uint64).astype(np.uint8)
            print("ok")
        elif cmd == "more":
            more = np.zeros(4096, np.uint8)
            assert e.register_memory(more.ctypes.data, more.nbytes) == 0
            print(more.ctypes.data)
        elif cmd == "more-hash":
            print(hashlib.sha256(more).hexdigest())
"""


@pytest.fixture
def engines(proc):
    """(target process, its session, its buffer address, a local TransferEngine)."""
    target = proc(TARGET)
    session, addr = target.read().split()
    local = TransferEngine()
    assert local.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert local.get_rpc_port() > 0
    return target, session, int(addr), local


def sha(a):
    return hashlib.sha256(a).hexdigest()


def test_batch_writes_and_reads_move_every_byte(engines):
    target, session, addr, local = engines
    src = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8)
    assert local.register_memory(src.ctypes.data, src.nbytes) == 0
    blk = 64 << 10
    offs = list(range(0, src.nbytes, blk))
    rc = local.batch_transfer_sync_write(
        session, [src.ctypes.data + o for o in offs], [addr + o for o in offs], [blk] * len(offs)
    )
    assert rc == 0
    target.send("hash")
    assert target.read() == sha(src)

    back = np.zeros(1 << 20, np.uint8)
    assert local.batch_register_memory([back.ctypes.data], [back.nbytes]) == 0
    assert local.transfer_sync_read(session, back.ctypes.data, addr, back.nbytes) == 0
    assert np.array_equal(back, src)
    assert local.batch_unregister_memory([src.ctypes.data, back.ctypes.data]) == 0


def test_async_batches_report_through_get_batch_transfer_status(engines):
    target, session, addr, local = engines
    target.send("fill")
    assert target.read() == "ok"
    dst = np.zeros(1 << 20, np.uint8)
    assert local.register_memory(dst.ctypes.data, dst.nbytes) == 0
    half = dst.nbytes // 2
    ids = [
        local.batch_transfer_async_read(session, [dst.ctypes.data], [addr], [half]),
        local.batch_transfer_async(
            session, [dst.ctypes.data + half], [addr + half], [half], TransferOpcode.READ
        ),
    ]
    assert all(i > 0 for i in ids) and ids[0] != ids[1]
    assert local.get_batch_transfer_status(ids) == 0
    assert np.array_equal(dst, np.arange(dst.nbytes, dtype=np.uint64).astype(np.uint8))
    assert local.get_batch_transfer_status(ids) < 0  # ids are released once reported
    b = local.transfer_submit_write(session, dst.ctypes.data, addr, 4096)
    assert b > 0
    status = local.transfer_check_status(b)
    while status == 0:
        time.sleep(0.001)
        status = local.transfer_check_status(b)
    assert status == 1


def test_addresses_outside_every_region_fail_and_write_nothing(engines):
    target, session, addr, local = engines
    src = np.full(8192, 0xAB, np.uint8)
    assert local.register_memory(src.ctypes.data, src.nbytes) == 0
    target.send("hash")
    before = target.read()
    # Past the end of the peer's only region, and straddling its end.
    assert local.transfer_sync_write(session, src.ctypes.data, addr + (1 << 20), 16) < 0
    assert local.transfer_sync_write(session, src.ctypes.data, addr + (1 << 20) - 8, 16) < 0
    assert local.transfer_sync_write(session, src.ctypes.data, addr - 4096, 16) < 0
    # Addresses at the top of the address space, and past it.
    assert local.transfer_sync_write(session, src.ctypes.data, 2**64 - 8, 16) < 0
    assert local.transfer_sync_write(session, 2**64 - 8, addr, 16) < 0
    assert local.transfer_sync_write(session, src.ctypes.data, 2**64, 16) < 0
    assert local.transfer_sync_write(session, src.ctypes.data, addr, -1) < 0
    # Local memory never registered.
    other = np.zeros(64, np.uint8)
    assert local.transfer_sync_write(session, other.ctypes.data, addr, 64) < 0
    assert local.batch_transfer_async_write(session, [other.ctypes.data], [addr], [64]) == 0
    # Mismatched lists, bad types, unknown batches, unknown peers.
    assert local.batch_transfer_sync_write(session, [src.ctypes.data], [addr, addr], [1]) < 0
    assert local.transfer_sync_write(session, "buffer", addr, 16) < 0
    assert local.get_batch_transfer_status([123456]) < 0
    assert local.unregister_memory(other.ctypes.data) < 0
    assert local.transfer_sync_write("127.0.0.1:1", src.ctypes.data, addr, 16) < 0
    target.send("hash")
    assert target.read() == before


def test_memory_the_peer_registers_later_is_found(engines):
    target, session, addr, local = engines
    src = np.full(4096, 0x5C, np.uint8)
    assert local.register_memory(src.ctypes.data, src.nbytes) == 0
    assert local.transfer_sync_write(session, src.ctypes.data, addr, 16) == 0  # connects
    target.send("more")
    more = int(target.read())
    assert local.transfer_sync_write(session, src.ctypes.data, more, 4096) == 0
    target.send("more-hash")
    assert target.read() == sha(src)


def test_a_dead_peer_fails_the_call_and_the_interpreter_survives(engines):
    target, session, addr, local = engines
    src = np.zeros(4096, np.uint8)
    assert local.register_memory(src.ctypes.data, src.nbytes) == 0
    assert local.transfer_sync_write(session, src.ctypes.data, addr, 16) == 0
    target.close()
    assert local.transfer_sync_write(session, src.ctypes.data, addr, 16) < 0
    b = local.batch_transfer_async_write(session, [src.ctypes.data], [addr], [16])
    assert b == 0 or local.get_batch_transfer_status([b]) < 0


def test_managed_buffers_and_byte_copies(engines):
    target, session, addr, local = engines
    buf = local.allocate_managed_buffer(4096)
    assert buf != 0
    assert local.write_bytes_to_buffer(buf, b"hello te", 8) == 0
    assert local.read_bytes_from_buffer(buf, 8) == b"hello te"
    assert local.write_bytes_to_buffer(buf + 4090, b"too long", 8) < 0
    assert local.transfer_sync_write(session, buf, addr, 4096) == 0
    assert local.get_first_buffer_address(session) == addr
    assert local.transfer_sync_read(session, buf, addr + 4096, 8) == 0
    assert local.read_bytes_from_buffer(buf, 8) == bytes(8)
    assert local.free_managed_buffer(buf, 4096) == 0


def test_calls_before_initialize_fail_cleanly():
    e = TransferEngine()
    assert e.get_rpc_port() < 0
    assert e.register_memory(4096, 16) < 0
    assert e.transfer_sync_write("127.0.0.1:1", 4096, 4096, 16) < 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "no-such-backend", "") < 0


PREFILL = """
    import sys
    import numpy as np
    import te
    layers, blocks, blk = 4, 16, 4096
    rng = np.random.default_rng(11)
    caches = [(rng.integers(0, 256, (blocks, blk), dtype=np.uint8),
               rng.integers(0, 256, (blocks, blk), dtype=np.uint8)) for _ in range(layers)]
    with te.Engine({"engine": {"backend": "tcp"}}) as e:
        e.register_kv_caches("kv", caches)
        print(e.address, e.name)
        got = e.recv_notification(timeout=20)
        print(got[0], got[2].decode() if got else None)
"""


def test_nixl_style_pull_with_a_notification_across_processes(proc):
    import te

    prefill = proc(PREFILL)
    addr, name = prefill.read().split()
    layers, blocks, blk = 4, 16, 4096
    rng = np.random.default_rng(11)
    expected = [(rng.integers(0, 256, (blocks, blk), dtype=np.uint8),
                 rng.integers(0, 256, (blocks, blk), dtype=np.uint8)) for _ in range(layers)]
    mine = [(np.zeros((8, blk), np.uint8), np.zeros((8, blk), np.uint8)) for _ in range(layers)]
    with te.Engine({"engine": {"backend": "tcp"}}) as e:
        e.register_kv_caches("kv", mine)
        peer = e.connect(addr, timeout=10)
        remote_ids = np.array([3, 4, 5, 9, 15], dtype=np.int64)
        local_ids = np.arange(5, dtype=np.int64)
        assert e.pull_blocks(peer, "kv", local_ids, remote_ids, notify=b"req-7 pulled").wait(20)
        for (k, v), (ek, ev) in zip(mine, expected):
            assert np.array_equal(k[:5], ek[remote_ids]) and np.array_equal(v[:5], ev[remote_ids])
        assert prefill.read() == f"{e.name} req-7 pulled"
