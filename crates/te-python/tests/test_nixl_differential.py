"""te.nixl against NIXL itself: one client, two implementations, the same results.

``nixl_clients/kv_pull.py`` plays vLLM's NixlConnector in pull mode (the decode side
READs blocks from the prefill side and notifies it) in two processes. It runs once
with ``te.nixl`` and once with NIXL's PyPI package (UCX over TCP on loopback), and
every observable result must agree: return values, bytes moved (each one checked),
telemetry counts, exceptions for bad input, notification contents and order.

NIXL's package is required: without it these tests fail, they do not skip
(``pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1``; see docs/nixl.md).
"""

import json
import pathlib
import subprocess
import sys

import pytest

from conftest import Proc

CLIENT = pathlib.Path(__file__).parent / "nixl_clients" / "kv_pull.py"

# UCX over TCP on loopback only: no shared memory, no other interface.
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}


class Client(Proc):
    """One role of kv_pull.py in its own process, spoken to line by line."""

    def __init__(self, role, impl):
        super().__init__(argv=[CLIENT, role, impl], env=UCX_ENV)

    def read(self):
        """The next JSON line the client printed (other lines are NIXL's logging)."""
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise AssertionError(f"the {self.p.args[2]} client exited ({self.p.wait()})")
            if line.startswith(("{", "[")):
                return json.loads(line)


def run(impl):
    """Runs the pull with ``impl`` (``te`` or ``nixl``): what the initiator saw, and
    what the target saw at each step it was asked about."""
    target = Client("target", impl)
    init = Client("initiator", impl)
    try:
        hs = target.read()
        init.send(json.dumps(hs))
        seen = {}
        while True:
            msg = init.read()
            if "results" in msg:
                break
            step = msg["ready"]
            if step == "notifs":
                expected = 3 if "reads" not in seen else 4
                target.send(f"notifs {expected}")
                seen["reads" if "reads" not in seen else "standalone"] = target.read()
            elif step == "sha":
                target.send("notifs 1")
                seen["write"] = target.read()
                target.send("sha")
                seen["sha"] = target.read()
            elif step.startswith("watch"):
                target.send(step)
                init.send("go")
                seen["watch"] = target.read()
                continue
            init.send("go")
        target.send("quit")
        assert target.p.wait(timeout=30) == 0
        assert init.p.wait(timeout=30) == 0
        return msg["results"], seen
    finally:
        target.close()
        init.close()


def test_nixl_package_is_installed():
    """The reference itself: NIXL's Python package with its UCX backend."""
    from nixl._api import nixl_agent, nixl_agent_config  # noqa: F401 (a missing package fails)
    from nixl._bindings import nixlXferTelemetry  # noqa: F401

    agent = nixl_agent("probe", nixl_agent_config(backends=["UCX"]))
    assert "UCX" in agent.backends


@pytest.fixture(scope="module")
def both():
    """(te.nixl's run, NIXL's run), each ``(initiator results, target observations)``."""
    return run("te"), run("nixl")


def test_reads_move_every_byte_and_report_the_same_telemetry(both):
    (te_res, _), (nixl_res, _) = both
    for name in ("read_scattered", "read_run"):
        assert te_res[name] == nixl_res[name], name
        assert te_res[name]["bytes_ok"] and te_res[name]["state"] == "DONE"
        assert te_res[name]["times_ok"]
    assert te_res["read_scattered"]["descCount"] == 64
    assert te_res["read_run"]["descCount"] == 1
    assert te_res["read_run"]["repost_state"] == "DONE" and te_res["read_run"]["repost_bytes_ok"]
    assert te_res["read_run"]["duration_covers_late_look"]
    assert te_res["no_notifs"] == nixl_res["no_notifs"] == {}
    assert te_res["add_remote_agent"] == nixl_res["add_remote_agent"] == {"bytes": "prefill"}


def test_notifications_arrive_with_the_same_contents_and_order(both):
    (_, te_seen), (_, nixl_seen) = both
    for step in ("reads", "standalone", "write"):
        assert te_seen[step] == nixl_seen[step], step
    assert te_seen["reads"] == {"decode": ["read-1", "read-2", "read-3"]}
    assert te_seen["standalone"] == {"decode": ["n-0", "n-1", "n-2", "n-3"]}
    assert te_seen["write"] == {"decode": ["write-1"]}


def test_a_reads_notification_arrives_after_the_data_was_read(both):
    """The target overwrites the blocks as soon as the READ's notification arrives;
    the reader must still have the original bytes."""
    (te_res, te_seen), (nixl_res, nixl_seen) = both
    assert te_seen["watch"] == nixl_seen["watch"] == {"decode": ["big-read"]}
    assert te_res["big_state"] == nixl_res["big_state"] == "DONE"
    assert te_res["big_bytes_ok"] and nixl_res["big_bytes_ok"]


def test_writes_land_in_the_targets_memory(both):
    (te_res, te_seen), (nixl_res, nixl_seen) = both
    assert te_res["write_post"] == nixl_res["write_post"] == {"value": True}
    assert te_res["write_state"] == nixl_res["write_state"] == "DONE"
    assert te_seen["sha"] == te_res["write_expected_sha"]
    assert nixl_seen["sha"] == nixl_res["write_expected_sha"]


def test_bad_input_raises_the_same_exceptions(both):
    (te_res, _), (nixl_res, _) = both
    assert set(te_res["bad"]) == set(nixl_res["bad"])
    differ = {
        k: (te_res["bad"][k], nixl_res["bad"][k])
        for k in te_res["bad"]
        if te_res["bad"][k] != nixl_res["bad"][k]
    }
    assert not differ, differ
    assert te_res["deregistered_twice"] == nixl_res["deregistered_twice"]
    # And the reference raised where the test expects it to (the comparison means
    # something only if the calls were bad).
    assert nixl_res["bad"]["index_out_of_range"]["raises"] == "nixlInvalidParamError"
    assert nixl_res["bad"]["prep_remote_outside"]["raises"] == "nixlNotFoundError"


def test_the_benchmark_runs_every_implementation_and_checks_its_bytes():
    """`python -m te.nixl_bench`, briefly: each implementation moves bytes and reads
    the right ones (a wrong byte ends the run with an error)."""
    out = subprocess.run(
        [sys.executable, "-m", "te.nixl_bench", "--json", "--duration", "0.4", "--warmup",
         "0.1", "--slices", "1", "--pool", "64", "--blocks", "8", "--window", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(res["gb_per_s"]) == {"te.nixl", "nixl", "native", "native-poll"}
    assert all(v > 0 for v in res["gb_per_s"].values())
    assert set(res["ratios"]) == {"te.nixl / nixl", "te.nixl / native", "te.nixl / native-poll"}
