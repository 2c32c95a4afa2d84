"""te's native Python API: two engines in one process, over tcp and the stub."""

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import te
import te.testing
from conftest import config


def pattern(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_every_error_kind_has_a_class_under_te_error():
    for kind in te._te.error_kinds():
        cls = te.errors.class_for(kind)
        assert issubclass(cls, te.Error) and cls.kind == kind
    assert issubclass(te.TimeoutError, TimeoutError)
    assert issubclass(te.InvalidRequestError, ValueError)


def test_engine_reports_its_address_name_epoch_and_backend(pair):
    target, init, peer = pair
    assert init.address.startswith("127.0.0.1:") and init.epoch > 0 and init.name
    assert peer.address == target.address and peer.name == target.name
    assert peer.epoch == target.epoch and peer.valid


def test_write_then_read_moves_every_byte(pair):
    target, init, peer = pair
    n = 256 << 10
    remote = np.zeros(n, dtype=np.uint8)
    local = pattern(n, 1)
    back = np.zeros(n, dtype=np.uint8)
    rreg = target.register_buffer(remote, name="dst")
    lreg = init.register_buffer(local)
    breg = init.register_buffer(back)
    reqs = [(lreg.id, i, rreg.id, i, 64 << 10) for i in range(0, n, 64 << 10)]
    assert init.transfer(peer, reqs, op="write").wait(10)
    assert np.array_equal(remote, local)
    arr = np.array([(breg.id, 0, rreg.id, 0, n)], dtype=np.int64)
    assert init.transfer(peer, arr, op="read").wait(10)
    assert np.array_equal(back, local)
    for r in (rreg, lreg, breg):
        r.deregister()


def test_register_takes_raw_pointers_and_tensor_like_objects(pair):
    target, init, peer = pair
    buf = np.zeros(4096, dtype=np.uint8)
    reg = target.register(buf.ctypes.data, buf.nbytes, device="host", name="raw", keep=buf)
    assert peer.region("raw") is None  # learnt on the next use, not before
    src = init.register_tensor(pattern(4096, 2))
    h = init.transfer(peer, [(src.id, 0, reg.id, 0, 4096)])
    assert h.wait(10) and h.done() and h.status() == "done" and h.error() is None
    assert peer.region("raw") == reg.id
    with pytest.raises(ValueError, match="not C-contiguous"):
        init.register_tensor(np.zeros((8, 8), dtype=np.uint8)[:, ::2])
    with pytest.raises(TypeError, match="read-only"):
        init.register_buffer(b"immutable")
    # Any item type registers as its bytes; what is not contiguous, or not a buffer,
    # is refused saying so.
    floats = np.arange(1024, dtype=np.float32)
    fr = target.register_buffer(floats, name="floats")
    h = init.transfer(peer, [(src.id, 0, fr.id, 0, 4096)])
    assert h.wait(10)
    assert floats.tobytes() == pattern(4096, 2).tobytes()
    with pytest.raises(TypeError, match="C-contiguous"):
        init.register_buffer(np.zeros((8, 8), dtype=np.float32)[:, ::2])
    with pytest.raises(TypeError, match="buffer protocol"):
        init.register_buffer(object())
    fr.deregister()
    with pytest.raises(TypeError, match="not a tensor"):
        init.register_tensor(object())


def test_registered_buffers_stay_where_they_are_until_deregistered():
    """A registered bytearray cannot be resized, a registered memoryview not released
    (the bytes would move under te, and a peer's WRITE land in another object); after
    deregister() both can."""
    with te.Engine(config("stub")) as e:
        ba = bytearray(4096)
        mv = memoryview(bytearray(4096))
        regs = [e.register_buffer(ba), e.register_buffer(mv)]
        with pytest.raises(BufferError):
            ba.extend(b"x" * (1 << 20))
        with pytest.raises(BufferError):
            mv.release()
        for r in regs:
            r.deregister()
        ba.extend(b"x")
        mv.release()


def test_read_only_arrays_are_refused_as_read_only_buffers_are(tmp_path):
    """te writes into registered memory (a peer's WRITE, a local READ): read-only memory
    registered as a tensor, as a KV cache or through ``__cuda_array_interface__`` is
    refused, as ``register_buffer`` refuses it. A peer's WRITE into a read-only
    mapping would crash this process; into ``bytes`` change an immutable object."""
    path = tmp_path / "ro.bin"
    path.write_bytes(bytes(4096))
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    frozen = np.frombuffer(b"\x00" * 4096, dtype=np.uint8)

    class ReadOnlyCudaArray:
        __cuda_array_interface__ = {
            "shape": (4096,), "typestr": "|u1", "data": (0x7E00_0000_0000, True),
            "strides": None, "version": 3,
        }

    with te.Engine(config("stub")) as e:
        for a in (mapped, frozen, ReadOnlyCudaArray()):
            with pytest.raises(TypeError, match="read-only"):
                e.register_tensor(a)
        with pytest.raises(TypeError, match="read-only"):
            e.register_kv_caches("kv", [frozen.reshape(4, 1024)])
        assert e.metrics()["registrations"] == []


class FakeTensor:
    """What te reads of a torch tensor, over a numpy array (torch is not needed)."""

    def __init__(self, a, device="cpu"):
        self.a, self.device, self.shape = a, device, a.shape

    def data_ptr(self):
        return self.a.ctypes.data

    def numel(self):
        return self.a.size

    def element_size(self):
        return self.a.itemsize

    def is_contiguous(self):
        return self.a.flags["C_CONTIGUOUS"]


def test_auto_registration_asks_who_owns_the_memory(pair):
    target, init, peer = pair
    remote = np.zeros(8192, dtype=np.uint8)
    rreg = target.register_buffer(remote, name="dst")
    host = pattern(4096, 7)
    hreg = init.register(host.ctypes.data, host.nbytes, device="auto", keep=host)
    assert hreg.device == "host"
    with te.testing.FakeDeviceBuffer(4096, ordinal=1) as dev:
        data = pattern(4096, 8).tobytes()
        dev.write(data)
        # Device memory named host is refused at registration, naming its owner.
        with pytest.raises(te.InvalidRequestError, match="it is memory of fakedev:1"):
            init.register(dev.ptr, 4096, device="host")
        dreg = init.register(dev.ptr, 4096, device="auto")
        assert dreg.device == "fakedev:1"
        reqs = [(dreg.id, 0, rreg.id, 0, 4096), (hreg.id, 0, rreg.id, 4096, 4096)]
        assert init.transfer(peer, reqs).wait(10)
        assert remote[:4096].tobytes() == data and (remote[4096:] == host).all()
        dreg.deregister()


@pytest.mark.parametrize("shape", ["pairs", "joint", "mla", "one-allocation"])
def test_kv_caches_pull_with_a_notification_after_the_data(pair, shape):
    target, init, peer = pair
    layers, blocks, blk = 3, 8, 1024

    def caches(seed):
        rng = np.random.default_rng(seed)
        mk = lambda *s: rng.integers(0, 256, s, dtype=np.uint8)  # noqa: E731
        if shape == "pairs":
            return [(mk(blocks, blk), mk(blocks, blk)) for _ in range(layers)]
        if shape == "joint":
            return {f"model.layers.{i}": mk(2, blocks, blk) for i in range(layers)}
        if shape == "mla":
            return [FakeTensor(mk(blocks, blk)) for _ in range(layers)]
        big = mk(layers, 2, blocks, blk)
        return [(big[i, 0], big[i, 1]) for i in range(layers)]

    src, dst = caches(3), caches(4)
    target.register_kv_caches("kv", src)
    regs = init.register_kv_caches("kv", dst)
    if shape == "one-allocation":
        assert len(regs) == 1
    remote_ids = np.array([1, 2, 3, 7], dtype=np.int64)
    local_ids = [0, 1, 2, 5]
    h = init.pull_blocks(peer, "kv", local_ids, remote_ids, notify=b"req-1 done", timeout=10)
    assert h.wait(10)

    def blocks_of(c, i):
        arr = lambda t: t.a if isinstance(t, FakeTensor) else t  # noqa: E731
        entries = list(c.values()) if isinstance(c, dict) else c
        out = []
        for e in entries:
            if isinstance(e, tuple):
                out += [arr(e[0])[i], arr(e[1])[i]]
            elif shape == "joint":
                out += [e[0, i], e[1, i]]
            else:
                out.append(arr(e)[i])
        return out

    for l_, r in zip(local_ids, remote_ids):
        for a, b in zip(blocks_of(dst, l_), blocks_of(src, r)):
            assert np.array_equal(a, b)
    deadline = time.monotonic() + 5
    got = {}
    while not got and time.monotonic() < deadline:
        got = target.get_notifications()
        time.sleep(0.01)
    assert got == {init.name: [b"req-1 done"]}
    assert target.get_notifications() == {}
    init.deregister_kv_caches("kv")
    target.deregister_kv_caches("kv")


def test_push_blocks_takes_ids_as_int64_tensors_and_selects_layers(pair):
    target, init, peer = pair
    src = [(pattern(4 * 512, 5).reshape(4, 512), pattern(4 * 512, 6).reshape(4, 512))]
    dst = [(np.zeros((4, 512), np.uint8), np.zeros((4, 512), np.uint8))]
    init.register_kv_caches("kv", src)
    target.register_kv_caches("kv", dst)

    class Ids(FakeTensor):
        def __init__(self, a, dtype="torch.int64"):
            super().__init__(a)
            self.dtype = dtype

    ids = Ids(np.array([0, 3], dtype=np.int64))
    h = init.push_blocks(peer, "kv", ids, [1, 2], layers=["layer0"], slots=["value"])
    assert h.wait(10)
    assert np.array_equal(dst[0][1][[1, 2]], src[0][1][[0, 3]])
    assert not dst[0][0].any()  # the key slot was not selected
    with pytest.raises(TypeError, match="int64 on the CPU"):
        init.push_blocks(peer, "kv", Ids(np.array([0], np.int32), "torch.int32"), [0])


def test_await_resolves_without_blocking_the_loop(pair):
    target, init, peer = pair
    dst = target.register_buffer(bytearray(1 << 20))
    src = init.register_buffer(bytearray(b"x" * (1 << 20)))

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        hs = [init.transfer(peer, [(src.id, 0, dst.id, 0, 1 << 20)]) for _ in range(8)]
        await asyncio.gather(*hs)
        t.cancel()
        return ticks

    assert asyncio.run(main()) > 0


def test_bad_requests_raise_the_error_of_their_kind(pair):
    target, init, peer = pair
    dst = target.register_buffer(bytearray(4096))
    src = init.register_buffer(bytearray(4096))
    with pytest.raises(te.OutOfBoundsError) as e:
        init.transfer(peer, [(src.id, 0, dst.id, 4000, 200)])
    assert e.value.kind == "OutOfBounds" and e.value.operation == "transfer"
    with pytest.raises(te.Error) as e:
        init.transfer(peer, [(src.id + 1000, 0, dst.id, 0, 16)])
    assert e.value.kind in ("NotRegistered", "InvalidRequest")
    with pytest.raises(te.InvalidRequestError):
        init.transfer(peer, [(src.id, 0, dst.id, 0, 0)])
    with pytest.raises(te.InvalidRequestError, match="not `write` or `read`"):
        init.transfer(peer, [], op="copy")
    with pytest.raises(TypeError):
        init.transfer(peer, [("a", 0, dst.id, 0, 1)])
    with pytest.raises(TypeError, match="non-negative"):
        init.transfer(peer, [(src.id, -1, dst.id, 0, 1)])
    with pytest.raises(ValueError, match="negative"):
        init.pull_blocks(peer, "kv", np.array([-1]), [0])
    with pytest.raises(ValueError, match="N×5"):
        init.transfer(peer, np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(TypeError):
        init.transfer("not a peer", [])
    with pytest.raises(te.NotRegisteredError, match="no local layout"):
        init.pull_blocks(peer, "nope", [0], [0])
    with pytest.raises(TypeError):
        init.pull_blocks(peer, "nope", "0", [0])
    with pytest.raises(ValueError, match="not one of"):
        init.register_buffer(bytearray(16), access="everything")
    with pytest.raises(te.InvalidRequestError):
        init.register(0, 16)


def test_fake_device_reads_past_their_allocation_are_refused_before_allocating():
    """A read longer than its fakedev allocation raises ``te.OutOfBoundsError`` naming
    the allocation, however long: the host buffer is not allocated first (an
    allocation of 64 TiB aborted the interpreter)."""
    code = """
import te, te.testing
with te.testing.FakeDeviceBuffer(64) as dev:
    dev.write(b"x" * 64)
    assert dev.read(8, offset=56) == b"x" * 8
    for n, offset in ((1 << 46, 0), (9, 56), ((1 << 64) - 1, 1)):
        try:
            dev.read(n, offset=offset)
        except te.OutOfBoundsError as e:
            assert "64-byte fakedev allocation" in str(e), e
        else:
            raise AssertionError(f"a read of {n} bytes at {offset} was not refused")
print("refused")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr[-2000:]


def test_integers_out_of_range_name_their_argument(pair):
    """A negative or oversized number says which argument (or config value) it was."""
    target, init, peer = pair
    for args, what in (((-1, 16), "ptr"), ((4096, -16), "nbytes"), ((2**64, 16), "ptr")):
        with pytest.raises(OverflowError, match=what):
            init.register(*args)
    with pytest.raises(TypeError, match="nbytes"):
        init.register(4096, "16")
    for ids in ([0, -1], np.array([-1])):
        with pytest.raises(ValueError, match="local_ids"):
            init.pull_blocks(peer, "kv", ids, [0, 1])
    with pytest.raises(ValueError, match="lengths"):
        init.transfer_addrs(peer, "write", [4096], [4096], [-16])
    with pytest.raises(OverflowError, match="2361183241434822606848"):
        te.Engine({"engine": {"backend": "stub", "default_timeout": 2**71}})


def test_a_timeout_too_large_for_the_clock_waits_without_limit(pair):
    target, init, peer = pair
    dst = target.register_buffer(bytearray(64), name="dst")
    src = init.register_buffer(bytearray(b"\x01" * 64))
    assert init.transfer(peer, [(src.id, 0, dst.id, 0, 64)], notify=b"hi").wait(1e19)
    # A completed batch's notification is in the target's inbox: this returns at once.
    assert target.recv_notification(1e19)[2] == b"hi"
    # Past what a Duration holds, infinity included, is no limit too.
    for t in (float("inf"), 1e300):
        h = init.transfer(peer, [(src.id, 0, dst.id, 0, 64)], notify=b"inf", timeout=t)
        assert h.wait(t)
        assert target.recv_notification(t)[2] == b"inf"
        assert init.connect(target.address, timeout=t).address == target.address
    for t, what in ((float("nan"), "not a number"), (-1.0, "negative")):
        with pytest.raises(ValueError, match=what):
            h.wait(t)
    for r in (dst, src):
        r.deregister()


def test_bad_configs_are_config_errors():
    with pytest.raises(te.ConfigInvalidError, match="nonsense"):
        te.Engine({"engine": {"backend": "stub", "nonsense": 1}})
    with pytest.raises(te.ConfigInvalidError, match="available"):
        te.Engine({"engine": {"backend": "no-such-backend"}})
    with pytest.raises(te.ConfigInvalidError):
        te.Engine("/nonexistent/te.toml")
    with pytest.raises(TypeError):
        te.Engine(42)


def test_dead_and_silent_peers_fail_within_the_timeout():
    with te.Engine(config("tcp")) as e:
        gone = te.Engine(config("tcp"))
        addr = gone.address
        gone.close()
        with pytest.raises(te.PeerUnreachableError):
            e.connect(addr, timeout=2)
        with pytest.raises(te.CancelledError, match="closed"):
            gone.connect(e.address)
        with socket.socket() as s:  # accepts, never answers
            s.bind(("127.0.0.1", 0))
            s.listen()
            t0 = time.monotonic()
            with pytest.raises((te.TimeoutError, te.PeerUnreachableError, te.ProtocolError)):
                e.connect("127.0.0.1:%d" % s.getsockname()[1], timeout=0.5)
            assert time.monotonic() - t0 < 5


def test_a_peer_that_dies_fails_the_next_batch_and_raises_an_event():
    with te.Engine(config("tcp")) as e:
        other = te.Engine(config("tcp"))
        dst = other.register_buffer(bytearray(4096))
        src = e.register_buffer(bytearray(4096))
        addr = other.address
        peer = e.connect(addr, timeout=5)
        assert e.transfer(peer, [(src.id, 0, dst.id, 0, 4096)]).wait(10)
        other.close()
        # Its close deregistered `dst` and stopped its backend, so a batch fails at
        # once, though the registration object lives; its deregister is then a no-op.
        with pytest.raises(te.Error):
            e.transfer(peer, [(src.id, 0, dst.id, 0, 4096)], timeout=3).wait(10)
        dst.deregister()
        # Its goodbye (or the broken session) is an event; from then on a batch to it
        # fails too.
        deadline = time.monotonic() + 5
        events = []
        while not events and time.monotonic() < deadline:
            events = e.get_peer_events()
            time.sleep(0.05)
        assert events and events[0]["address"] == addr
        assert events[0]["kind"] in ("left", "lost")
        with pytest.raises(te.Error) as err:
            e.transfer(peer, [(src.id, 0, dst.id, 0, 4096)], timeout=3).wait(10)
        assert err.value.kind in ("PeerUnreachable", "PeerRestarted", "Timeout", "Cancelled")


def slow_pair(**stub):
    a = te.Engine(config("stub", **stub))
    b = te.Engine(config("stub", **stub))
    dst = a.register_buffer(bytearray(4096))
    src = b.register_buffer(bytearray(4096))
    # The registrations live as long as the engines' test does.
    a.keep, b.keep = dst, src
    return a, b, b.connect(a.address), [(src.id, 0, dst.id, 0, 4096)]


def test_wait_returns_false_while_pending_and_cancel_resolves_with_cancelled():
    a, b, peer, reqs = slow_pair(delay="2s")
    with a, b:
        h = b.transfer(peer, reqs)
        t0 = time.monotonic()
        assert h.wait(0.2) is False and not h.done() and h.status() == "pending"
        assert 0.15 < time.monotonic() - t0 < 1.5
        h.cancel()
        with pytest.raises(te.CancelledError):
            h.wait(10)
        assert h.done() and isinstance(h.error(), te.CancelledError)


def test_a_deregister_while_another_is_under_way_returns_after_it():
    """Neither of two threads deregistering one region returns while a batch still
    reads it (a caller frees raw memory once deregister() returns)."""
    a, b, peer, reqs = slow_pair(delay="2s")
    with a, b:
        h = b.transfer(peer, reqs)
        first = threading.Thread(target=b.keep.deregister)
        first.start()
        time.sleep(0.3)  # the first deregister now waits for the batch
        b.keep.deregister()
        assert h.done()
        first.join(10)
        assert not first.is_alive()


def switches(tid):
    """The context switches thread `tid` of this process has made."""
    n = 0
    with open("/proc/self/task/%d/status" % tid) as f:
        for line in f:
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                n += int(line.split()[1])
    return n


def test_a_thread_waiting_in_te_is_not_woken_until_its_wait_ends():
    """A batch's wait, a notification's and a second deregister's sleep until their
    event: the waiting thread makes no context switch meanwhile (it used to wake ten
    times a second to look for Ctrl-C)."""
    a, b, peer, reqs = slow_pair(delay="3s")
    with a, b:
        h = b.transfer(peer, reqs)
        waits = {
            "Handle.wait": lambda: h.wait(20),
            "recv_notification": lambda: a.recv_notification(2.5),
            "deregister": b.keep.deregister,
        }
        first = threading.Thread(target=b.keep.deregister)  # waits for the batch
        first.start()
        time.sleep(0.2)
        tids, threads = {}, []
        for name, wait in waits.items():
            def run(name=name, wait=wait):
                tids[name] = threading.get_native_id()
                wait()
            threads.append(threading.Thread(target=run))
            threads[-1].start()
        time.sleep(0.5)  # past the batch wait's first, driving slice
        before = {n: switches(t) for n, t in tids.items()}
        time.sleep(1.5)
        woken = {n: switches(t) - before[n] for n, t in tids.items()}
        for t in threads + [first]:
            t.join(20)
            assert not t.is_alive()
        assert h.done()
        assert all(n <= 1 for n in woken.values()), woken


@pytest.mark.parametrize("wait", ["Handle.wait", "recv_notification", "deregister"])
def test_ctrl_c_interrupts_a_wait_on_the_main_thread(wait):
    """SIGINT reaches the main thread asleep in a wait, which raises KeyboardInterrupt
    at once; the batch and the engine are unharmed."""
    import signal

    assert threading.current_thread() is threading.main_thread()
    a, b, peer, reqs = slow_pair(delay="3s")
    with a, b:
        h = b.transfer(peer, reqs)
        first = None
        if wait == "deregister":
            first = threading.Thread(target=b.keep.deregister)
            first.start()
            time.sleep(0.2)
        calls = {
            "Handle.wait": lambda: h.wait(20),
            "recv_notification": lambda: a.recv_notification(20),
            "deregister": b.keep.deregister,
        }
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        t0 = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            calls[wait]()
        assert time.monotonic() - t0 < 2.5
        timer.join()
        assert h.wait(20)
        if first:
            first.join(20)


def test_close_stops_the_engine_while_another_thread_waits_in_it():
    """close() waits for calls in flight on other threads (a notification wait stops
    with te.CancelledError), so no peer writes into a region once it has returned."""
    with te.Engine(config("stub")) as init:
        target = te.Engine(config("stub"))
        dst = np.zeros(4096, dtype=np.uint8)
        reg = target.register(dst.ctypes.data, dst.nbytes, name="dst")  # raw, no keep
        src = init.register_buffer(bytearray(b"\x5a" * 4096))
        peer = init.connect(target.address, timeout=5)
        cancelled = []

        def wait():
            with pytest.raises(te.CancelledError) as e:
                target.recv_notification(30)
            cancelled.append(e.value)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.3)  # the waiter is now inside recv_notification
        t0 = time.monotonic()
        target.close()
        assert time.monotonic() - t0 < 5
        with pytest.raises(te.Error):
            init.transfer(peer, [(src.id, 0, reg.id, 0, 4096)]).wait(10)
        waiter.join(10)
        assert not waiter.is_alive() and len(cancelled) == 1
        assert not dst.any()


def test_close_says_when_a_call_outlasts_the_default_timeout():
    """A call on another thread that runs past default_timeout: close() raises
    te.TimeoutError, and the engine stops when that call returns."""
    cfg = config("stub")
    cfg["engine"]["default_timeout"] = "0.3s"
    e = te.Engine(cfg)
    host, port = e.address.split(":")
    failed = []
    with socket.socket() as s:  # accepts, never answers
        s.bind(("127.0.0.1", 0))
        s.listen()

        def connect():
            with pytest.raises(te.Error) as err:
                e.connect("127.0.0.1:%d" % s.getsockname()[1], timeout=2)
            failed.append(err.value)

        caller = threading.Thread(target=connect)
        caller.start()
        time.sleep(0.3)  # the caller is now inside connect
        with pytest.raises(te.TimeoutError, match="other threads"):
            e.close()
        with pytest.raises(te.CancelledError, match="closed"):
            e.address
        caller.join(10)
        assert not caller.is_alive() and len(failed) == 1
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_a_batch_past_its_deadline_raises_te_timeout_error():
    a, b, peer, reqs = slow_pair(delay="3s")
    with a, b:
        with pytest.raises(te.TimeoutError):
            b.transfer(peer, reqs, timeout=0.3).wait(10)


def test_awaiting_a_failed_batch_raises_its_error():
    a, b, peer, reqs = slow_pair(fail_every=1)
    with a, b:
        async def main():
            await b.transfer(peer, reqs)

        with pytest.raises(te.BackendError):
            asyncio.run(main())


def test_torch_cuda_tensors_move_between_engines():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    with te.Engine(config("tcp")) as a, te.Engine(config("tcp")) as b:
        src = torch.arange(1 << 20, dtype=torch.uint8, device="cuda:0") % 251
        dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
        rd = a.register_tensor(dst)
        rs = b.register_tensor(src)
        assert rd.device == "cuda:0"
        peer = b.connect(a.address)
        assert b.transfer(peer, [(rs.id, 0, rd.id, 0, 1 << 20)]).wait(30)
        torch.cuda.synchronize()
        assert torch.equal(src, dst)


def test_metrics_count_what_moved_and_a_handle_tells_its_batch(pair):
    target, init, peer = pair
    remote = np.zeros(8192, dtype=np.uint8)
    rreg = target.register_buffer(remote, name="dst")
    local = pattern(8192, 3)
    lreg = init.register_buffer(local)
    h = init.transfer(peer, [(lreg.id, 0, rreg.id, 0, 4096), (lreg.id, 4096, rreg.id, 4096, 4096)])
    assert h.telemetry() is None or h.done()
    assert h.wait(10)
    t = h.telemetry()
    assert (t["requests"], t["bytes"]) == (2, 8192)
    assert 0 <= t["post_us"] <= t["duration_us"] and t["start_time"] > 1.7e9
    # The stub has one way to its peers and names none; te-tcp says how it reaches a
    # peer of this process.
    assert init.path_to(peer) in (None, "in-process device copies (host memory over the socket)")
    # Stages a backend does not time are None; those it does fit in the batch.
    for stage in ("queued_us", "wire_us", "device_us"):
        assert t[stage] is None or 0 <= t[stage] <= t["duration_us"]
    m = init.metrics()
    assert (m["batches_submitted"], m["batches_completed"], m["batches_failed"]) == (1, 1, [])
    assert (m["bytes_written"], m["requests_written"]) == (8192, 2)
    assert m["latency"]["count"] == 1 and len(m["latency"]["counts"]) == len(m["latency"]["bounds_us"]) + 1
    assert [p["address"] for p in m["peers"]] == [target.address]
    assert {"kind": "host", "count": 1, "bytes": 8192} in m["registrations"]
