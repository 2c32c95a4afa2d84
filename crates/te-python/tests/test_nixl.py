"""te.nixl: NIXL's agent API over te, two agents in this process over tcp.

What NIXL itself does is compared in test_nixl_differential.py; these tests cover
what that comparison cannot: te's own guarantees behind the API (a released handle
no longer touches memory, threads, telemetry measured by te, te errors as NIXL
exceptions) and the parts of the API the differential client does not call.
"""

import pickle
import sys
import threading
import time
import types

import numpy as np
import pytest

import te
from te.nixl import _bindings as B
from te.nixl._api import nixl_agent, nixl_agent_config
from te.nixl._requests import merge
from te.nixl._regions import RegionTable

BS = 4096


def wait_done(agent, h, timeout=10.0):
    end = time.monotonic() + timeout
    while (state := agent.check_xfer_state(h)) == "PROC":
        assert time.monotonic() < end, "the transfer did not complete"
        time.sleep(0.001)
    return state


def notifs(agent, count, timeout=10.0):
    """Notifications until ``count`` arrived: ``{agent: [bytes, …]}``."""
    got, end = {}, time.monotonic() + timeout
    while sum(map(len, got.values())) < count and time.monotonic() < end:
        for k, v in agent.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.001)
    return got


class Side:
    """An agent and ``blocks`` blocks of registered host memory."""

    def __init__(self, name, blocks=64, fill=None, telemetry=True):
        self.agent = nixl_agent(name, nixl_agent_config(capture_telemetry=telemetry))
        self.mem = np.zeros(blocks * BS, np.uint8) if fill is None else fill(blocks * BS)
        rows = [(self.mem.ctypes.data, self.mem.nbytes, 0, "")]
        self.reg = self.agent.register_memory(rows, "DRAM")

    def descs(self, blocks=None, base=None):
        n = len(self.mem) // BS if blocks is None else blocks
        b = self.mem.ctypes.data if base is None else base
        return np.array([(b + i * BS, BS, 0) for i in range(n)], np.uint64)


def random_bytes(n):
    return np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def pair():
    """(target side with random bytes, initiator side, remote name, local list,
    remote list)."""
    tgt = Side("prefill", fill=random_bytes)
    ini = Side("decode")
    name = ini.agent.add_remote_agent(tgt.agent.get_agent_metadata())
    lh = ini.agent.prep_xfer_dlist("NIXL_INIT_AGENT", ini.descs(), "DRAM")
    rh = ini.agent.prep_xfer_dlist(name, ini.agent.get_xfer_descs(tgt.descs(), "DRAM"))
    return tgt, ini, name, lh, rh


def test_a_read_moves_every_byte_and_notifies_the_owner(pair):
    tgt, ini, name, lh, rh = pair
    assert name == b"prefill"
    li = np.array([5, 0, 63, 7], np.int64)
    ri = np.array([1, 2, 3, 40], np.int64)
    h = ini.agent.make_prepped_xfer("READ", lh, li, rh, ri, notif_msg=b"req-1")
    assert ini.agent.transfer(h) in ("PROC", "DONE")
    assert wait_done(ini.agent, h) == "DONE"
    for a, b in zip(li, ri):
        assert np.array_equal(ini.mem[a * BS:(a + 1) * BS], tgt.mem[b * BS:(b + 1) * BS])
    assert notifs(tgt.agent, 1) == {"decode": [b"req-1"]}
    ini.agent.release_xfer_handle(h)


def test_a_write_lands_and_a_handle_can_be_posted_again(pair):
    tgt, ini, name, lh, rh = pair
    ini.mem[:] = random_bytes(ini.mem.nbytes)[::-1]
    h = ini.agent.make_prepped_xfer("WRITE", lh, [0, 1], rh, [10, 11], notif_msg="w")
    for round_ in range(3):
        ini.agent.transfer(h, notif_msg=f"w{round_}".encode() if round_ else b"")
        assert wait_done(ini.agent, h) == "DONE"
    assert np.array_equal(tgt.mem[10 * BS:12 * BS], ini.mem[:2 * BS])
    assert notifs(tgt.agent, 3) == {"decode": [b"w", b"w1", b"w2"]}


def test_telemetry_is_measured_by_te_and_counts_merged_requests(pair):
    _, ini, _, lh, rh = pair
    before = time.monotonic_ns() // 1000
    h = ini.agent.make_prepped_xfer("READ", lh, np.arange(8), rh, np.arange(8))
    with pytest.raises(B.nixlNotPostedError):
        ini.agent.get_xfer_telemetry(h)
    ini.agent.transfer(h)
    wait_done(ini.agent, h)
    t = ini.agent.get_xfer_telemetry(h)
    after = time.monotonic_ns() // 1000
    assert isinstance(t, B.nixlXferTelemetry)
    assert (t.totalBytes, t.descCount) == (8 * BS, 1)
    assert before <= t.startTime <= after
    assert 0 < t.xferDuration <= after - t.startTime
    assert 0 <= t.postDuration <= t.xferDuration
    split = ini.agent.make_prepped_xfer("READ", lh, np.arange(8), rh, np.arange(8),
                                        skip_desc_merge=True)
    ini.agent.transfer(split)
    wait_done(ini.agent, split)
    assert ini.agent.get_xfer_telemetry(split).descCount == 8


def test_telemetry_off_raises_no_telemetry(pair):
    tgt, _, _, _, _ = pair
    quiet = Side("quiet", telemetry=False)
    name = quiet.agent.add_remote_agent(tgt.agent.get_agent_metadata())
    lh = quiet.agent.prep_xfer_dlist("", quiet.descs(1), "DRAM")
    rh = quiet.agent.prep_xfer_dlist(name, tgt.descs(1), "DRAM")
    h = quiet.agent.make_prepped_xfer("READ", lh, [0], rh, [0])
    quiet.agent.transfer(h)
    wait_done(quiet.agent, h)
    with pytest.raises(B.nixlNoTelemetryError):
        quiet.agent.get_xfer_telemetry(h)


def big_pair(nbytes):
    tgt = nixl_agent("big-target")
    ini = nixl_agent("big-initiator")
    src = np.full(nbytes, 7, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    tgt.register_memory([(src.ctypes.data, nbytes, 0, "")], "DRAM")
    reg = ini.register_memory([(dst.ctypes.data, nbytes, 0, "")], "DRAM")
    name = ini.add_remote_agent(tgt.get_agent_metadata())
    lh = ini.prep_xfer_dlist("", [(dst.ctypes.data, nbytes, 0)], "DRAM")
    rh = ini.prep_xfer_dlist(name, [(src.ctypes.data, nbytes, 0)], "DRAM")
    h = ini.make_prepped_xfer("READ", lh, [0], rh, [0], notif_msg=b"big")
    return (tgt, src), ini, reg, dst, h


def test_releasing_a_transfer_in_flight_waits_until_te_let_go_of_it():
    _keep, ini, reg, dst, h = big_pair(256 << 20)
    ini.transfer(h)
    with pytest.raises(B.nixlRepostActiveError):
        ini.transfer(h)
    te_handle = h._xfer.handle
    ini.release_xfer_handle(h)
    assert te_handle.done(), "release returned while te still held the batch"
    snapshot = dst.copy()
    time.sleep(0.2)
    assert np.array_equal(dst, snapshot), "bytes still arrived after release"
    ini.deregister_memory(reg)
    with pytest.raises(B.nixlInvalidParamError):
        ini.check_xfer_state(h)


def test_a_loopback_transfer_reads_the_agents_own_memory():
    side = Side("solo", blocks=8, fill=random_bytes)
    lh = side.agent.prep_xfer_dlist("NIXL_INIT_AGENT", side.descs(), "DRAM")
    rh = side.agent.prep_xfer_dlist("solo", side.descs(), "DRAM")
    h = side.agent.make_prepped_xfer("READ", lh, [0, 1], rh, [6, 7], notif_msg=b"self")
    side.agent.transfer(h)
    assert wait_done(side.agent, h) == "DONE"
    assert np.array_equal(side.mem[:2 * BS], side.mem[6 * BS:])
    assert notifs(side.agent, 1) == {"solo": [b"self"]}


def test_metadata_added_again_reaches_memory_registered_later(pair):
    tgt, ini, name, lh, rh = pair
    more = np.arange(BS, dtype=np.uint8)
    with pytest.raises(B.nixlNotFoundError):
        ini.agent.prep_xfer_dlist(name, [(more.ctypes.data, BS, 0)], "DRAM")
    tgt.agent.register_memory(np.array([[more.ctypes.data, BS, 0]], np.uint64), "DRAM")
    assert ini.agent.add_remote_agent(tgt.agent.get_agent_metadata()) == name
    rh2 = ini.agent.prep_xfer_dlist(name, [(more.ctypes.data, BS, 0)], "DRAM")
    for remote_list, idx in ((rh2, 0), (rh, 3)):  # the list prepared before still works
        h = ini.agent.make_prepped_xfer("READ", lh, [idx], remote_list, [idx])
        ini.agent.transfer(h)
        assert wait_done(ini.agent, h) == "DONE"
    assert np.array_equal(ini.mem[:BS], more)


def test_strided_rows_expand_to_one_descriptor_per_block(pair):
    tgt, ini, name, lh, _ = pair
    base = tgt.mem.ctypes.data
    # Blocks 1, 3, 5, 7 (stride two blocks), then 20 and 21.
    strided = np.array([[base + BS, BS, 0, 2 * BS, 4], [base + 20 * BS, BS, 0, BS, 2]], np.uint64)
    with pytest.raises(ValueError):
        ini.agent.prep_xfer_dlist(name, strided)
    rh = ini.agent.prep_xfer_dlist(name, strided, "DRAM")
    h = ini.agent.make_prepped_xfer("READ", lh, np.arange(6), rh, np.arange(6))
    ini.agent.transfer(h)
    wait_done(ini.agent, h)
    want = np.concatenate([tgt.mem[b * BS:(b + 1) * BS] for b in (1, 3, 5, 7, 20, 21)])
    assert np.array_equal(ini.mem[:6 * BS], want)


def test_threads_share_one_agent():
    tgt = Side("shared-target", blocks=256, fill=random_bytes)
    ini = Side("shared-initiator", blocks=256)
    name = ini.agent.add_remote_agent(tgt.agent.get_agent_metadata())
    lh = ini.agent.prep_xfer_dlist("", ini.descs(), "DRAM")
    rh = ini.agent.prep_xfer_dlist(name, tgt.descs(), "DRAM")
    errors = []

    def worker(t):
        try:
            rng = np.random.default_rng(t)
            for i in range(20):
                li = t * 64 + rng.permutation(64)[:16]
                ri = rng.permutation(256)[:16]
                h = ini.agent.make_prepped_xfer("READ", lh, li, rh, ri,
                                                notif_msg=f"{t}-{i}".encode())
                ini.agent.transfer(h)
                assert wait_done(ini.agent, h) == "DONE"
                for a, b in zip(li, ri):
                    assert np.array_equal(ini.mem[a * BS:(a + 1) * BS],
                                          tgt.mem[b * BS:(b + 1) * BS])
                ini.agent.release_xfer_handle(h)
                # Registrations change while the other threads transfer.
                scratch = np.zeros(BS, np.uint8)
                reg = ini.agent.register_memory([(scratch.ctypes.data, BS, 0, "")], "DRAM")
                ini.agent.deregister_memory(reg)
        except Exception as e:  # noqa: BLE001 (reported by the test)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    got = notifs(tgt.agent, 80)["shared-initiator"]
    assert sorted(got) == sorted(f"{t}-{i}".encode() for t in range(4) for i in range(20))
    for t in range(4):  # each thread's notifications in the order it sent them
        mine = [m for m in got if m.startswith(f"{t}-".encode())]
        assert mine == [f"{t}-{i}".encode() for i in range(20)]


def test_te_errors_surface_as_nixl_exceptions(pair):
    tgt, ini, name, lh, rh = pair
    h = ini.agent.make_prepped_xfer("READ", lh, [0], rh, [0])
    ini.agent.deregister_memory(ini.reg)
    with pytest.raises(B.nixlNotFoundError) as e:
        ini.agent.transfer(h)
    assert isinstance(e.value.__cause__, te.NotRegisteredError)
    assert str(e.value).startswith("NIXL_ERR_NOT_FOUND: ")


def test_vram_that_is_host_memory_is_refused_with_a_backend_error():
    agent = nixl_agent("no-gpu")
    buf = np.zeros(BS, np.uint8)
    with pytest.raises(B.nixlBackendError, match="is host memory"):
        agent.register_memory([(buf.ctypes.data, BS, 0, "")], "VRAM")
    with pytest.raises(B.nixlNotFoundError):
        agent.register_memory([(buf.ctypes.data, BS, 0, "")], "FILE")
    # Nothing stayed registered, then the same memory registers as DRAM.
    with pytest.raises(B.nixlNotFoundError):
        agent.prep_xfer_dlist("", [(buf.ctypes.data, BS, 0)], "DRAM")
    agent.register_memory([(buf.ctypes.data, BS, 0, "")], "DRAM")


def test_any_backend_name_is_accepted():
    agent = nixl_agent("named", nixl_agent_config(backends=["UCX", "LIBFABRIC"]))
    assert agent.get_plugin_list() == ["UCX", "LIBFABRIC"]
    assert set(agent.backends) == {"UCX", "LIBFABRIC"}
    buf = np.zeros(BS, np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, BS, 0, "")], "DRAM", backends=["MOONCAKE"])
    agent.deregister_memory(reg, backends=["UCX"])


def test_descriptor_lists_pickle_and_index_like_nixls():
    agent = nixl_agent("lists")
    x = agent.get_xfer_descs([(1, 2, 0), (3, 4, 5)], "DRAM")
    r = agent.get_reg_descs([(1, 2, 0, "meta")], "VRAM")
    assert (x.descCount(), x[1], x.getType()) == (2, (3, 4, 5), B.DRAM_SEG)
    assert (r[0], r.getType()) == ((1, 2, 0, b"meta"), B.VRAM_SEG)
    back = agent.deserialize_descs(agent.get_serialized_descs(x))
    assert np.array_equal(back.array, x.array) and back.getType() == x.getType()
    assert pickle.loads(pickle.dumps(r))[0] == r[0]
    assert agent.get_xfer_descs(r) is None and agent.get_reg_descs(x) is None


def test_calls_te_does_not_offer_say_so():
    agent = nixl_agent("plain")
    for call in (agent.send_local_metadata, agent.fetch_remote_metadata, agent.estimate_xfer_cost):
        with pytest.raises(B.nixlNotSupportedError, match="te.nixl does not offer"):
            call("x")


def test_region_table_finds_regions_that_overlap():
    # Region 2 lies inside region 1; region 3 starts inside it and runs past its end.
    table = RegionTable([(1, 1000, 500, 0, 0), (2, 1100, 50, 0, 0), (3, 1400, 400, 0, 0),
                         (4, 5000, 10, 1, 2)])
    descs = np.array([[1000, 500, 0], [1160, 100, 0], [1450, 300, 0], [5002, 8, 2]], np.uint64)
    ids, offs = table.locate(0, descs[:3])
    assert ids.tolist() == [1, 1, 3] and offs.tolist() == [0, 160, 50]
    ids, offs = table.locate(1, descs[3:])
    assert ids.tolist() == [4] and offs.tolist() == [2]
    for bad, mem in (([[1450, 400, 0]], 0), ([[5002, 8, 0]], 1), ([[5002, 8, 2]], 0),
                     ([[900, 10, 0]], 0), ([[2**64 - 4, 8, 0]], 0)):
        with pytest.raises(LookupError):
            table.locate(mem, np.array(bad, np.uint64))


def test_adjacent_requests_merge_only_when_both_sides_continue():
    req = np.array([
        [1, 0, 9, 100, 10],
        [1, 10, 9, 110, 10],   # continues the row before on both sides
        [1, 20, 9, 200, 10],   # local continues, remote jumps
        [2, 30, 9, 210, 10],   # another local region
        [2, 40, 9, 220, 5],
    ], np.uint64)
    assert merge(req).tolist() == [
        [1, 0, 9, 100, 20], [1, 20, 9, 200, 10], [2, 30, 9, 210, 15],
    ]


class FakeTensor:
    """What te.nixl reads of a torch tensor, over a numpy array (torch is not needed)."""

    def __init__(self, arr, gpu=-1):
        self.arr, self.gpu = arr, gpu
        self.device = "cpu" if gpu < 0 else f"cuda:{gpu}"

    def data_ptr(self):
        return self.arr.ctypes.data

    def numel(self):
        return self.arr.size

    def element_size(self):
        return self.arr.itemsize

    def get_device(self):
        return self.gpu

    def is_contiguous(self):
        return self.arr.flags["C_CONTIGUOUS"]


def test_tensors_become_descriptors_of_their_memory(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(Tensor=FakeTensor))
    agent = nixl_agent("tensors")
    a, b = np.zeros(256, np.float32), np.zeros(64, np.int64)
    reg = agent.register_memory(FakeTensor(a))
    assert (reg.getType(), reg[0][:3]) == (B.DRAM_SEG, (a.ctypes.data, a.nbytes, 0))
    x = agent.get_xfer_descs([FakeTensor(a), FakeTensor(b)])
    assert x.array.tolist() == [[a.ctypes.data, a.nbytes, 0], [b.ctypes.data, b.nbytes, 0]]
    v = agent.get_reg_descs(FakeTensor(b, gpu=3))
    assert (v.getType(), v[0][2]) == (B.VRAM_SEG, 3)
    assert agent.get_xfer_descs([FakeTensor(a), FakeTensor(b, gpu=0)]) is None
    assert agent.get_reg_descs(FakeTensor(a[::2])) is None
    agent.deregister_memory(reg)


def test_a_removed_agent_takes_no_more_transfers(pair):
    _, ini, name, lh, rh = pair
    h = ini.agent.make_prepped_xfer("READ", lh, [0], rh, [0])
    ini.agent.remove_remote_agent(name)
    with pytest.raises(B.nixlNotFoundError):
        ini.agent.transfer(h)
    with pytest.raises(B.nixlNotFoundError):
        ini.agent.send_notif(name, b"gone")


VRAM_TARGET = """
    import numpy as np, te.testing
    from te.nixl._api import nixl_agent
    BS, N = 4096, 64
    dev = te.testing.FakeDeviceBuffer(BS * N, ordinal=1)
    dev.write(np.random.default_rng(5).integers(0, 256, BS * N, dtype=np.uint8).tobytes())
    agent = nixl_agent("prefill")
    agent.register_memory([(dev.ptr, BS * N, 1, "")], "VRAM")
    print(agent.get_agent_metadata().hex(), dev.ptr, flush=True)
    got = {}
    while not got:
        got = agent.get_new_notifs()
    print(repr(got), flush=True)
    input()
"""


def test_two_processes_pull_blocks_of_device_memory_registered_as_vram(proc):
    """vLLM's pull mode, both sides' blocks in (fake) device memory that te finds by
    asking its device runtimes: every block read arrives, and the notification after."""
    import te.testing

    n = 64
    target = proc(VRAM_TARGET)
    meta, base = target.read().split()
    base = int(base)
    src = np.random.default_rng(5).integers(0, 256, BS * n, dtype=np.uint8).tobytes()
    with te.testing.FakeDeviceBuffer(BS * n, ordinal=0) as dev:
        agent = nixl_agent("decode")
        reg = agent.register_memory([(dev.ptr, BS * n, 0, "")], "VRAM")
        assert [r.device for regs in agent._regs.values() for r in regs] == ["fakedev:0"]
        remote = agent.add_remote_agent(bytes.fromhex(meta))
        local = agent.prep_xfer_dlist("", [(dev.ptr + i * BS, BS, 0) for i in range(n)], "VRAM")
        far = agent.prep_xfer_dlist(
            remote, [(base + i * BS, BS, 1) for i in range(n)], "VRAM"
        )
        ids = np.random.default_rng(6).permutation(n).astype(np.int64)
        h = agent.make_prepped_xfer("READ", local, np.arange(n, dtype=np.int64), far, ids,
                                    notif_msg=b"req-7")
        assert agent.transfer(h) in ("PROC", "DONE")
        assert wait_done(agent, h) == "DONE"
        got = dev.read()
        for i, j in enumerate(ids):
            assert got[i * BS:(i + 1) * BS] == src[j * BS:(j + 1) * BS], f"block {i} <- {j}"
        assert target.read() == repr({"decode": [b"req-7"]})
        agent.release_xfer_handle(h)
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(far)
        agent.deregister_memory(reg)
    target.send("")
