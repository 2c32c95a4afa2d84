"""te.mooncake: Mooncake's TransferEngine calls, across two processes.

What te.mooncake shares with Mooncake is checked against Mooncake's wheel in
test_mooncake_differential.py; these tests need only te: the rdma protocol on a host
without RDMA, memory registered without a location (host and fakedev device memory),
the environment variables Mooncake reads, and te's own checks."""

import hashlib
import logging
import time

import numpy as np
import pytest

import te
from te import mooncake
from te.mooncake import TransferEngine, TransferNotify, TransferOpcode
from te.testing import FakeDeviceBuffer

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
            session, [dst.ctypes.data + half], [addr + half], [half], TransferOpcode.Read
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
    # Addresses at the top of the address space; past it, pybind11's TypeError.
    assert local.transfer_sync_write(session, src.ctypes.data, 2**64 - 8, 16) < 0
    assert local.transfer_sync_write(session, 2**64 - 8, addr, 16) < 0
    with pytest.raises(TypeError):
        local.transfer_sync_write(session, src.ctypes.data, 2**64, 16)
    with pytest.raises(TypeError):
        local.transfer_sync_write(session, src.ctypes.data, addr, -1)
    with pytest.raises(TypeError):
        local.transfer_sync_write(session, "buffer", addr, 16)
    # Local memory never registered (Mooncake's TCP transport would read it anyway).
    other = np.zeros(64, np.uint8)
    assert local.transfer_sync_write(session, other.ctypes.data, addr, 64) < 0
    assert local.batch_transfer_async_write(session, [other.ctypes.data], [addr], [64]) == 0
    assert local.transfer_submit_write(session, other.ctypes.data, addr, 64) == 0
    # Mismatched lists, unknown batches, unknown peers.
    assert local.batch_transfer_sync_write(session, [src.ctypes.data], [addr, addr], [1]) < 0
    assert local.get_batch_transfer_status([123456]) < 0
    assert local.unregister_memory(other.ctypes.data) == mooncake.ERR_ADDRESS_NOT_REGISTERED
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
    assert local.send_probe(session) == 0
    target.close()
    assert local.transfer_sync_write(session, src.ctypes.data, addr, 16) < 0
    b = local.batch_transfer_async_write(session, [src.ctypes.data], [addr], [16])
    assert b == 0 or local.get_batch_transfer_status([b]) < 0
    assert local.send_probe(session) == mooncake.ERR_SOCKET


def test_managed_buffers_and_byte_copies(engines):
    target, session, addr, local = engines
    buf = local.allocate_managed_buffer(4096)
    assert buf != 0
    assert local.write_bytes_to_buffer(buf, b"hello te", 8) == 0
    assert local.read_bytes_from_buffer(buf, 8) == b"hello te"
    assert local.write_bytes_to_buffer(buf + 4090, b"too long", 8) < 0
    assert local.register_memory(buf + 1024, 16) == mooncake.ERR_ADDRESS_OVERLAPPED
    assert local.transfer_sync_write(session, buf, addr, 4096) == 0
    assert local.get_first_buffer_address(session) == addr
    assert local.transfer_sync_read(session, buf, addr + 4096, 8) == 0
    assert local.read_bytes_from_buffer(buf, 8) == bytes(8)
    assert local.free_managed_buffer(buf, 4096) == 0
    # More than any machine has: 0, as Mooncake returns, not an exception.
    assert local.allocate_managed_buffer(1 << 62) == 0


def test_a_free_on_another_thread_waits_for_a_byte_copy_into_the_buffer(engines, monkeypatch):
    """free_managed_buffer returns only after a write_bytes_to_buffer under way into
    that buffer has ended: the copy never lands in freed memory."""
    import threading

    import te.mooncake as mc

    target, session, addr, local = engines
    buf = local.allocate_managed_buffer(4096)
    assert buf != 0
    real, ended = mc.ctypes.memmove, []

    def slow_memmove(dst, src, n):
        time.sleep(0.3)
        real(dst, src, n)
        ended.append(time.monotonic())

    monkeypatch.setattr(mc.ctypes, "memmove", slow_memmove)
    writer = threading.Thread(target=local.write_bytes_to_buffer, args=(buf, b"late", 4))
    writer.start()
    time.sleep(0.1)  # the writer is inside its copy
    assert local.free_managed_buffer(buf, 4096) == 0
    freed = time.monotonic()
    writer.join(5)
    assert ended and ended[0] <= freed, "the buffer was freed while a copy into it ran"


def test_calls_before_initialize_fail_cleanly():
    e = TransferEngine()
    assert e.get_rpc_port() < 0
    assert e.register_memory(4096, 16) < 0
    assert e.transfer_sync_write("127.0.0.1:1", 4096, 4096, 16) < 0
    assert e.batch_transfer_async_write("127.0.0.1:1", [4096], [4096], [16]) == 0
    assert e.send_probe("127.0.0.1:1") < 0
    assert e.get_notifies() == []
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "no-such-backend", "") < 0
    assert e.initialize("127.0.0.1", "redis://127.0.0.1:6379", "tcp", "") < 0


# The rdma protocol on a host without RDMA devices, memory registered without a
# location: host memory and fakedev device memory (addresses the host cannot read).
RDMA_TARGET = """
    import hashlib, sys
    import numpy as np
    from te.mooncake import TransferEngine
    from te.testing import FakeDeviceBuffer
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    dev = FakeDeviceBuffer(1 << 20)
    dev.write(np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8))
    host = np.zeros(1 << 20, np.uint8)
    assert e.batch_register_memory([dev.ptr, host.ctypes.data], [dev.nbytes, host.nbytes]) == 0
    print(f"127.0.0.1:{e.get_rpc_port()} {dev.ptr} {host.ctypes.data} {e.get_engine().backend}")
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "hash":
            print(hashlib.sha256(dev.read()).hexdigest(), hashlib.sha256(host).hexdigest())
"""


def test_rdma_falls_back_to_tcp_without_devices_and_moves_device_memory(proc, caplog):
    target = proc(RDMA_TARGET)
    session, dev_addr, host_addr, backend = target.read().split()
    dev_addr, host_addr = int(dev_addr), int(host_addr)
    caplog.set_level(logging.WARNING, logger="te.mooncake")
    local = TransferEngine()
    assert local.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    # On a host with RDMA devices both sides use them; on others both fall back.
    assert backend == local.get_engine().backend
    assert (backend == "tcp") == ("falling back to tcp" in caplog.text)
    assert backend in ("tcp", "rdma")

    # No location: te finds that the target's first region is fakedev memory.
    regions = local.get_engine().connect(session).regions()
    assert sorted(r["device"] for r in regions) == ["fakedev:0", "host"]

    n = 1 << 20
    mine = FakeDeviceBuffer(n)
    staging = np.zeros(n, np.uint8)
    assert local.batch_register_memory([mine.ptr, staging.ctypes.data], [n, n]) == 0
    # The target's device memory into ours (device to device), 64 blocks in reverse
    # order; then ours into the target's host memory.
    blk = n // 64
    assert local.batch_transfer_sync_read(
        session, [mine.ptr + i * blk for i in range(64)],
        [dev_addr + (63 - i) * blk for i in range(64)], [blk] * 64) == 0
    expected = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    got = np.frombuffer(mine.read(), np.uint8)
    assert np.array_equal(got.reshape(64, blk), expected.reshape(64, blk)[::-1])
    assert local.transfer_sync_write(session, mine.ptr, host_addr, n) == 0
    target.send("hash")
    assert target.read().split() == [sha(expected), sha(got)]
    assert local.batch_unregister_memory([mine.ptr, staging.ctypes.data]) == 0
    mine.free()


def test_mc_force_tcp_forces_the_tcp_backend(monkeypatch, caplog):
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    caplog.set_level(logging.WARNING, logger="te.mooncake")
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "stub", "") == 0
    assert e.get_engine().backend == "tcp"
    assert "MC_FORCE_TCP" in caplog.text


@pytest.mark.parametrize("value,seconds", [
    (None, 30), ("12", 12), ("1", 5), ("0", 5), ("-3", 5), ("abc", 5), ("7s", 7),
    ("9" * 30, (1 << 31) - 1),
])
def test_mc_transfer_timeout_is_read_once_and_at_least_five_seconds(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("MC_TRANSFER_TIMEOUT", value)
    e = TransferEngine()
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "99")  # too late: read at construction
    assert e._timeout == seconds
    if value == "9" * 30:  # a transfer is still submitted with it
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "stub", "") == 0
        src = np.zeros(16, np.uint8)
        assert e.register_memory(src.ctypes.data, src.nbytes) == 0
        peer = e.get_engine().address
        assert e.transfer_sync_write(peer, src.ctypes.data, src.ctypes.data, 16) == 0


def test_locations_name_host_device_or_auto():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    host = np.zeros(3 * 4096, np.uint8)
    a = host.ctypes.data
    assert e.register_memory(a, 4096, "cpu:0") == 0
    assert e.register_memory(a + 4096, 4096) == 0  # "*": te finds it is host memory
    assert e.register_memory(a + 8192, 4096, "fakedev:0") == mooncake.FAILED  # not its owner
    with FakeDeviceBuffer(4096) as dev:
        assert e.register_memory(dev.ptr, 4096, "cpu:1") == mooncake.FAILED  # not host memory
        assert e.batch_register_memory([dev.ptr], [4096], location="*") == 0
        devices = {addr: reg.device for addr, reg in e._regs.items()}
        assert devices == {a: "host", a + 4096: "host", dev.ptr: "fakedev:0"}
        assert e.unregister_memory(dev.ptr) == 0


def test_notifications_from_te_s_own_api_carry_the_sender_s_name():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    with te.Engine({"engine": {"backend": "tcp", "listen": "127.0.0.1:0"}}) as native:
        peer = native.connect(f"127.0.0.1:{e.get_rpc_port()}", timeout=10)
        assert native.notify(peer, b"plain").wait(10)
        got = []
        end = time.monotonic() + 10
        while not got and time.monotonic() < end:
            got = e.get_notifies()
            time.sleep(0.01)
        assert [(n.name, n.msg) for n in got] == [(native.name, "plain")]
    assert repr(TransferNotify("a", "b")) == "TransferNotify(name='a', msg='b')"


def test_a_second_initialize_starts_a_new_engine():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    old = f"127.0.0.1:{e.get_rpc_port()}"
    buf = np.zeros(4096, np.uint8)
    assert e.register_memory(buf.ctypes.data, 4096) == 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert f"127.0.0.1:{e.get_rpc_port()}" != old
    assert e.send_probe(old) == mooncake.ERR_SOCKET  # the first engine is gone
    assert e.unregister_memory(buf.ctypes.data) == mooncake.ERR_ADDRESS_NOT_REGISTERED
    assert e.register_memory(buf.ctypes.data, 4096) == 0


def test_a_second_initialize_with_bad_arguments_keeps_the_working_engine():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    port = e.get_rpc_port()
    buf = np.zeros(4096, np.uint8)
    assert e.register_memory(buf.ctypes.data, 4096) == 0
    assert e.initialize("127.0.0.1", "redis://127.0.0.1:6379", "tcp", "") < 0
    assert e.initialize("no-such-host.invalid", "P2PHANDSHAKE", "tcp", "") < 0
    assert e.initialize("127.0.0.1:notaport", "P2PHANDSHAKE", "tcp", "") < 0
    assert e.get_rpc_port() == port
    assert e.send_probe(f"127.0.0.1:{port}") == 0
    assert e.unregister_memory(buf.ctypes.data) == 0


def test_calls_te_cannot_offer_exist_and_fail_as_mooncake_does(caplog):
    caplog.set_level(logging.INFO, logger="te.mooncake")
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    with pytest.raises(RuntimeError, match="CUDA stream"):
        e.batch_transfer_write_on_cuda(f"127.0.0.1:{e.get_rpc_port()}", [1], [1], [1], 0)
    assert e.get_engine_ptr() == 0
    assert e.warmup_efa_segment("127.0.0.1:1") == 0
    assert "no Mooncake C++ engine" in caplog.text and "no EFA transport" in caplog.text


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
