"""te.mooncake against Mooncake's own wheel: the same clients, the same results.

Each client in ``mooncake_clients/`` runs as two processes, once with ``te.mooncake``
and once with ``mooncake.engine`` from the ``mooncake-transfer-engine`` wheel (TCP on
loopback, P2P handshake), and every observable result must agree: return codes of
every call including the error cases, exceptions, bytes moved (each one checked),
notifications and their order.

- ``engine_calls.py``: every call the frameworks make, and their error cases.
- ``vllm_connector.py``: vLLM's MooncakeConnector (prefill pushes KV blocks to decode
  with ``batch_transfer_sync_write`` from a pool of threads).
- ``sglang_backend.py``: SGLang's Mooncake backend (``rdma`` as it asks, deduplicated
  registrations, page and aux transfers, ``send_probe`` before and after the peer
  goes away).

The wheel is required: without it these tests fail, they do not skip. It needs
``libcudart.so.12`` (the ``nvidia-cuda-runtime-cu12`` wheel) and a ``libcuda.so.1``;
on machines without NVIDIA's driver the ``mooncake_env`` fixture builds
``fakecuda/fake_libcuda.c`` (a driver that reports no device) with ``cc``.
"""

import importlib.util
import json
import os
import pathlib
import queue
import subprocess
import sys
import threading

import pytest

HERE = pathlib.Path(__file__).parent
CLIENTS = HERE / "mooncake_clients"
FAKE_LIBCUDA = HERE / "fakecuda" / "fake_libcuda.c"
#: Seconds a client may take to print its next line.
LINE_TIMEOUT = 60


@pytest.fixture(scope="session")
def mooncake_env(tmp_path_factory):
    """The environment Mooncake's wheel imports in on a machine without a GPU driver:
    ``LD_LIBRARY_PATH`` names the CPU-only ``libcuda.so.1`` built from
    fakecuda/fake_libcuda.c and the directory of the CUDA runtime wheel's
    ``libcudart.so.12``."""
    assert importlib.util.find_spec("mooncake") is not None, "pip install mooncake-transfer-engine"
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    assert spec is not None, "pip install nvidia-cuda-runtime-cu12 (Mooncake's libcudart.so.12)"
    cudart = pathlib.Path(next(iter(spec.submodule_search_locations))) / "lib"
    assert (cudart / "libcudart.so.12").exists(), f"no libcudart.so.12 in {cudart}"
    libdir = tmp_path_factory.mktemp("fakecuda")
    subprocess.run(["cc", "-shared", "-fPIC", "-Wall", "-o", str(libdir / "libcuda.so.1"),
                    str(FAKE_LIBCUDA)], check=True)
    path = [str(libdir), str(cudart)]
    if os.environ.get("LD_LIBRARY_PATH"):
        path.append(os.environ["LD_LIBRARY_PATH"])
    return dict(os.environ, PYTHONUNBUFFERED="1", LD_LIBRARY_PATH=os.pathsep.join(path))


class Client:
    """One role of a client script in its own process, spoken to in JSON lines."""

    def __init__(self, script, role, impl, env, log_dir):
        self.name = f"{script}:{role}:{impl}"
        self.log = open(log_dir / f"{script}-{role}-{impl}.log", "w+")
        self.p = subprocess.Popen(
            [sys.executable, str(CLIENTS / script), role, impl],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
        )
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.p.stdout:
            if line.startswith(("{", "[")):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def read(self):
        """The client's next JSON line."""
        try:
            msg = self.lines.get(timeout=LINE_TIMEOUT)
        except queue.Empty:
            raise AssertionError(f"{self.name} printed nothing for {LINE_TIMEOUT} s{self.tail()}")
        if msg is None:
            raise AssertionError(f"{self.name} exited ({self.p.wait()}){self.tail()}")
        return msg

    def send(self, obj):
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def wait(self):
        assert self.p.wait(timeout=LINE_TIMEOUT) == 0, f"{self.name} failed{self.tail()}"

    def tail(self):
        self.log.seek(0)
        return "\n--- its stderr ---\n" + self.log.read()[-3000:]

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        self.log.close()


def drive(script, impl, env, log_dir):
    """Runs ``script``'s target and initiator with ``impl``: the handshake goes from the
    target to the initiator, each ``{"ask": COMMAND}`` of the initiator to the target
    and its answer back (``quit``: once the target exited). Returns the initiator's
    results."""
    target = Client(script, "target", impl, env, log_dir)
    init = Client(script, "initiator", impl, env, log_dir)
    try:
        init.send(target.read())
        while "results" not in (msg := init.read()):
            target.send(msg["ask"])
            if msg["ask"][0] == "quit":
                target.wait()
                init.send({"done": True})
            else:
                init.send(target.read())
        init.wait()
        return msg["results"]
    finally:
        target.close()
        init.close()


def differences(a, b, path=""):
    """The paths where the nested dicts ``a`` and ``b`` differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = {}
        for k in sorted(set(a) | set(b)):
            out.update(differences(a.get(k), b.get(k), f"{path}/{k}"))
        return out
    return {} if a == b else {path: (a, b)}


@pytest.fixture(scope="module")
def runs(mooncake_env, tmp_path_factory):
    """``{script: (te.mooncake's results, Mooncake's results)}``, each script run once
    per implementation."""
    logs = tmp_path_factory.mktemp("mooncake-clients")
    cache = {}

    def run(script):
        if script not in cache:
            cache[script] = (drive(script, "te", mooncake_env, logs),
                             drive(script, "mooncake", mooncake_env, logs))
        return cache[script]

    return run


def test_the_mooncake_wheel_imports(mooncake_env):
    """The reference itself: Mooncake's wheel, on this machine."""
    out = subprocess.run([sys.executable, "-c", "import mooncake.engine as m; "
                          "print(m.TransferEngine().__class__.__module__)"],
                         env=mooncake_env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "mooncake.engine"


def test_every_call_returns_what_mooncake_returns(runs):
    te_res, mc_res = runs("engine_calls.py")
    assert not differences(te_res, mc_res), differences(te_res, mc_res)
    # The comparison means something only if the calls did what the test meant:
    # the reference refused what it should and moved the bytes it should.
    reg = mc_res["registrations"]
    assert [reg["same_again"], reg["inside"], reg["batch_overlapping_itself"]] == [-7] * 3
    assert [reg["zero_length"], reg["batch_with_zero"]] == [-1, -1]
    assert [reg["unregister_unknown"], reg["batch_unregister_partial"]] == [-3, -3]
    assert reg["after_batch_unregister_partial"] == -7
    assert reg["second_initialize"] == 0 and reg["unregister_after_second_initialize"] == -3
    assert reg["negative_length"] == {"raises": "TypeError"}
    local = mc_res["local"]
    assert [local["probe_unresolvable"], local["probe_dead"]] == [-101, -102]
    assert local["write_on_cuda"] == {"raises": "RuntimeError"}
    tr = mc_res["transfers"]
    assert tr["probe_live"] == 0
    assert tr["batch_read_bytes"] and tr["sync_read_bytes"] and tr["async_read_bytes"]
    assert [tr["zero_length_entries"], tr["empty_batch"], tr["mismatched_lists"]] == [0, 0, -1]
    assert tr["past_the_end"] == -1 and tr["async_past_the_end"]
    assert tr["int_opcode"] == {"raises": "TypeError"}
    assert mc_res["bytes_when_notified"]
    assert mc_res["after_peer_exit"]["probe"] == -102


def test_notifications_arrive_in_order_after_their_data(runs):
    te_res, mc_res = runs("engine_calls.py")
    expected = [["req-1", "written"], ["req-2", "two blocks"], ["req-3", "read"], ["req-4", "kw"]]
    assert mc_res["target_notifies"] == te_res["target_notifies"] == expected
    assert te_res["bytes_when_notified"] and mc_res["bytes_when_notified"]
    assert te_res["target_notifies_drained"] == mc_res["target_notifies_drained"] == []


def test_vllm_connector_pushes_every_block(runs):
    te_res, mc_res = runs("vllm_connector.py")
    assert not differences(te_res, mc_res), differences(te_res, mc_res)
    assert mc_res["initialize"] == 0 and mc_res["register"] == 0
    assert all(rc == 0 for rc in mc_res["sends"].values())
    assert mc_res["blocks_ok"] and mc_res["untouched_ok"]
    assert mc_res["out_of_range_send"] == -1


def test_sglang_backend_transfers_and_probes(runs):
    te_res, mc_res = runs("sglang_backend.py")
    assert not differences(te_res, mc_res), differences(te_res, mc_res)
    assert mc_res["initialize"] == 0 and mc_res["kv_register"] == 0
    assert mc_res["aux_register_again"] == -7
    assert mc_res["pages"] == 0 and mc_res["aux"] == 0 and mc_res["bytes_ok"]
    assert mc_res["probe_live"] == 0 and mc_res["probe_after_exit"] == -102
    assert mc_res["pages_after_exit"] < 0


def test_the_benchmark_runs_every_implementation_and_checks_its_bytes():
    """scripts/bench-mooncake.py, briefly: each implementation moves bytes and a batch
    into zeroed blocks is checked (a wrong byte ends the run with an error)."""
    out = subprocess.run(
        [sys.executable, str(HERE.parents[2] / "scripts" / "bench-mooncake.py"), "--json",
         "--duration", "0.2", "--rounds", "1", "--pool", "256", "--batches", "8",
         "--blocks", "16"],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for op in ("write", "read"):
        assert set(res["gb_per_s"][op]) == {"te.mooncake", "native", "mooncake"}
        assert all(v > 0 for v in res["gb_per_s"][op].values())
        assert set(res["ratios"][op]) == {"te.mooncake / mooncake", "te.mooncake / native"}
