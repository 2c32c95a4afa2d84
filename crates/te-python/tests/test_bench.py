"""python -m te.bench runs both of its modes (a short run; speed is not tested here)."""

import json
import pathlib

import pytest

from te import bench


def test_bench_reports_plain_and_kv_throughput(capsys):
    assert bench.main(["--backend", "stub", "--block-size", "4KiB", "--batch", "4",
                       "--duration", "100ms", "--warmup", "0s", "--json"]) == 0
    assert bench.main(["--backend", "tcp", "--kv", "--kv-layers", "2", "--kv-blocks", "8",
                       "--kv-heads", "1", "--kv-head-dim", "64", "--batch", "4",
                       "--duration", "100ms", "--warmup", "0s", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["mode"] for r in rows] == ["", "contiguous", "random"]
    assert all(r["gb_per_s"] > 0 for r in rows)
    assert rows[1]["block_size"] == 1 * 64 * 16 * 2 and rows[1]["op"] == "read"


def test_kv_compare_runs_the_rust_bench_with_the_options_it_takes(capsys):
    # The `te` binary the workspace's tests built (scripts/test.sh runs cargo first).
    te = pathlib.Path(__file__).resolve().parents[3] / "target" / "debug" / "te"
    if not te.exists():
        pytest.skip(f"{te} is not built (cargo build first)")
    assert bench.main(["--backend", "tcp", "--kv", "--kv-layers", "2", "--kv-blocks", "8",
                       "--kv-heads", "1", "--kv-head-dim", "64", "--batch", "4",
                       "--duration", "100ms", "--warmup", "0s", "--json",
                       "--compare", str(te)]) == 0
    assert "does not take" not in capsys.readouterr().err
