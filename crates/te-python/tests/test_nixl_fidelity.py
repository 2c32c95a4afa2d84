"""te.nixl where it is easy to get wrong: a release racing a post, the notification a
request keeps, descriptor merging, memory type names and damaged metadata.

The NIXL expectations below were observed with the installed ``nixl==1.5.1``
(UCX_TLS=tcp UCX_NET_DEVICES=lo, two agents in one process) running the same calls.
Every test is bounded in time: risky calls run in threads joined with a timeout.
"""

import json
import threading
import time

import numpy as np
import pytest

from te.nixl import _bindings as B
from te.nixl._api import nixl_agent, nixl_agent_config

BS = 4096


def wait_done(agent, h, timeout=10.0):
    end = time.monotonic() + timeout
    while (state := agent.check_xfer_state(h)) == "PROC":
        assert time.monotonic() < end, "the transfer did not complete"
        time.sleep(0.001)
    return state


def drain(agent, count, timeout=10.0):
    got, end = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < end:
        for msgs in agent.get_new_notifs().values():
            got.extend(msgs)
        time.sleep(0.001)
    time.sleep(0.2)  # nothing more may arrive
    for msgs in agent.get_new_notifs().values():
        got.extend(msgs)
    return got


def two_agents(prefix, telemetry=False):
    """(initiator, target, initiator memory (zeros), target memory (0x55), remote name)."""
    conf = nixl_agent_config(capture_telemetry=telemetry)
    ini, tgt = nixl_agent(f"{prefix}-ini", conf), nixl_agent(f"{prefix}-tgt", conf)
    mi = np.zeros(16 * BS, np.uint8)
    mt = np.full(16 * BS, 0x55, np.uint8)
    ini.register_memory([(mi.ctypes.data, mi.nbytes, 0, "")], "DRAM")
    tgt.register_memory([(mt.ctypes.data, mt.nbytes, 0, "")], "DRAM")
    name = ini.add_remote_agent(tgt.get_agent_metadata())
    return ini, tgt, mi, mt, name


def test_release_racing_a_post_leaves_nothing_in_flight():
    """``release_xfer_handle`` promises that te no longer touches the transfer's memory
    once it returns, and a released handle raises ``nixlInvalidParamError`` when used.
    A post that passed ``transfer()``'s first check when another thread released the
    handle must not post: ``transfer()`` looks again under the transfer's lock, which
    ``release()`` takes. The hook below widens that window (between ``_xfer()`` and
    ``with x.lock``) so the interleaving happens every run."""
    ini, _tgt, mi, _mt, name = two_agents("race")
    lh = ini.prep_xfer_dlist("", [(mi.ctypes.data, BS, 0)], "DRAM")
    rh = ini.prep_xfer_dlist(name, [(_mt.ctypes.data, BS, 0)], "DRAM")
    h = ini.make_prepped_xfer("READ", lh, [0], rh, [0])

    original = ini._check_remote
    inside, go = threading.Event(), threading.Event()

    def paused(remote):
        inside.set()
        go.wait(10)
        return original(remote)

    ini._check_remote = paused  # called by transfer() between its check and its lock
    outcome = {}

    def post():
        try:
            outcome["post"] = ini.transfer(h)
        except Exception as e:  # noqa: BLE001 (the outcome is checked below)
            outcome["post"] = e

    t = threading.Thread(target=post, daemon=True)
    t.start()
    assert inside.wait(10)
    releaser = threading.Thread(target=ini.release_xfer_handle, args=(h,), daemon=True)
    releaser.start()
    releaser.join(10)
    assert not releaser.is_alive(), "release_xfer_handle hung"
    go.set()
    t.join(10)
    assert not t.is_alive(), "transfer() hung"
    time.sleep(0.5)
    assert np.all(mi[:BS] == 0), (
        f"bytes landed after release_xfer_handle returned (transfer() gave {outcome['post']!r})"
    )
    assert isinstance(outcome["post"], B.nixlInvalidParamError), outcome


def test_a_notification_given_to_transfer_stays_the_handles_notification():
    """NIXL's postXferReq stores a non-empty ``notif_msg`` in the request: later posts
    without one send it again. NIXL 1.5.1 sends ``orig, second, second, second`` for
    the posts below (and ``late, late`` for the second handle), and so does te.nixl."""
    ini, tgt, mi, mt, name = two_agents("notif")
    lh = ini.prep_xfer_dlist("", [(mi.ctypes.data, BS, 0)], "DRAM")
    rh = ini.prep_xfer_dlist(name, [(mt.ctypes.data, BS, 0)], "DRAM")
    h = ini.make_prepped_xfer("READ", lh, [0], rh, [0], notif_msg=b"orig")
    for msg in (b"", b"second", b"", b""):
        ini.transfer(h, msg)
        assert wait_done(ini, h) == "DONE"
    h2 = ini.make_prepped_xfer("READ", lh, [0], rh, [0])
    for msg in (b"", b"late", b""):
        ini.transfer(h2, msg)
        assert wait_done(ini, h2) == "DONE"
    got = drain(tgt, 6)
    assert got == [b"orig", b"second", b"second", b"second", b"late", b"late"]


def test_initialize_xfer_does_not_merge_descriptors_as_nixl():
    """NIXL's ``initialize_xfer`` (createXferReq) keeps every descriptor: 8 adjacent
    blocks report ``descCount == 8`` (NIXL 1.5.1), as in te.nixl."""
    ini, _tgt, mi, mt, name = two_agents("init", telemetry=True)
    local = ini.get_xfer_descs([(mi.ctypes.data + i * BS, BS, 0) for i in range(8)], "DRAM")
    remote = ini.get_xfer_descs([(mt.ctypes.data + i * BS, BS, 0) for i in range(8)], "DRAM")
    h = ini.initialize_xfer("READ", local, remote, name)
    ini.transfer(h)
    assert wait_done(ini, h) == "DONE"
    t = ini.get_xfer_telemetry(h)
    assert (t.totalBytes, t.descCount) == (8 * BS, 8)


def test_backend_memory_types_are_named_as_nixl_names_them():
    """NIXL 1.5.1: ``get_backend_mem_types("UCX")`` and ``get_plugin_mem_types("UCX")``
    are ``['DRAM_SEG', 'VRAM_SEG']`` (the nixl_mem_t names), as in te.nixl."""
    agent = nixl_agent("memtypes", nixl_agent_config(backends=["UCX"]))
    assert agent.get_plugin_mem_types("UCX") == ["DRAM_SEG", "VRAM_SEG"]
    assert agent.get_backend_mem_types("UCX") == ["DRAM_SEG", "VRAM_SEG"]


@pytest.mark.parametrize("field,value", [(1, -1), (2, 2**64), (2, float("inf")), (1, 1e400)])
def test_damaged_metadata_raises_nixl_mismatch(field, value):
    """Metadata whose region numbers do not fit 64 unsigned bits (or are infinite) is
    damaged metadata: NIXL and te.nixl answer ``nixlMismatchError``."""
    a, b = nixl_agent(f"md-a{field}"), nixl_agent(f"md-b{field}")
    mem = np.zeros(BS, np.uint8)
    b.register_memory([(mem.ctypes.data, BS, 0, "")], "DRAM")
    md = b.get_agent_metadata()
    magic = b"te.nixl/1\n"
    body = json.loads(md[len(magic):])
    body["regions"][0][field] = value
    with pytest.raises(B.nixlMismatchError):
        a.add_remote_agent(magic + json.dumps(body).encode())


def test_metadata_nested_past_the_parsers_depth_raises_nixl_mismatch():
    """Metadata arrives from the network: arrays nested deeper than the JSON parser
    recurses are damaged metadata, not a ``RecursionError``."""
    a = nixl_agent("md-deep")
    with pytest.raises(B.nixlMismatchError):
        a.add_remote_agent(b"te.nixl/1\n" + b"[" * 100_000 + b"]" * 100_000)
