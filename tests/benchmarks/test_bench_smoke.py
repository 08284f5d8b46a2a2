"""The benchmark scripts still run: ``--quick`` in a subprocess, JSON with sane numbers.

Only that they work is checked here; how fast is the benchmarks' business (a timed test on
a shared 2-core machine would only be flaky).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Every test here starts processes (see tests/conftest.py).
pytestmark = pytest.mark.cluster

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
MODES = {
    "RANK_ZERO",
    "ONE_TO_ALL",
    "ALL_TO_ALL",
    "DP_COMPUTE",
    "DP_COMPUTE_PROTO",
    "DP_COMPUTE_PROTO padded",
    "DP_COMPUTE_PROTO_WITH_FUNC",
    "DP_COMPUTE_METRIC",
    "ND mesh (tp=2)",
}


def run_script(name: str, *args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(BENCH / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=BENCH.parent,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.timeout(120)
def test_bench_dispatch_quick(tmp_path: Path) -> None:
    proc = run_script("bench_dispatch.py", "--quick", "--out", str(tmp_path))
    result = json.loads((tmp_path / "dispatch_quick.json").read_text())
    rows = result["rows"]
    assert result["meta"]["quick"] is True
    assert {r["mode"] for r in rows} == MODES
    assert {r["backend"] for r in rows} == {"local", "dask-task", "dask-direct"}
    assert {r["call_path"] for r in rows if r["backend"] != "local"} <= {"task", "direct"}
    assert {(r["world_size"], r["payload_mib"]) for r in rows} == {(2, 0), (2, 1)}
    assert len(rows) == len(MODES) * 2 * 3
    for row in rows:
        assert 0 < row["median_s"] <= row["p90_s"] < 60, row
        assert len(row["rank_received_bytes_per_call"]) == 2
        if row["payload_mib"] == 1:
            assert row["throughput_gb_per_s"] > 0, row
            # every mode hands rank 0 some of the payload (about half, or all of it)
            assert row["rank_received_bytes_per_call"][0] >= (1 << 20) // 2, row
        if row["backend"] != "local":
            assert row["driver_bytes_per_call"] >= 0, row
    assert "DP_COMPUTE_PROTO" in proc.stdout


@pytest.mark.timeout(120)
def test_compare_verl_quick(tmp_path: Path) -> None:
    proc = run_script("compare_verl.py", "--quick", "--no-verl", "--out", str(tmp_path))
    result = json.loads((tmp_path / "compare_verl_quick.json").read_text())
    assert "verl side skipped" in proc.stdout
    assert result["meta"]["call_path"] in {"direct", "task"}
    assert result["verl"] is None
    cases = {row["case"]: row for row in result["table"]}
    assert set(cases) == {
        "backend + group of 2 ready",
        "first backend + group of 2 ready",
        "no-op ONE_TO_ALL call",
        "no-op RANK_ZERO call",
        "back-to-back non-blocking no-op calls",
        "DP_COMPUTE_PROTO identity 1 MiB",
        "1 MiB chain A -> B, separate pools",
    }
    for case, summary in result["ours"].items():
        assert 0 < summary["median_s"] <= summary["p90_s"], case
    for row in cases.values():
        assert row["ours"] > 0 and row["verl"] is None, row
    # the no-op cases and the burst say what CPU a rank call took, driver and ranks
    cpu = {row["case"]: row for row in result["cpu_per_rank_call_us"]}
    assert set(cpu) == {
        "no-op ONE_TO_ALL call",
        "no-op RANK_ZERO call",
        "back-to-back non-blocking no-op calls",
    }
    for row in cpu.values():
        assert row["ours_driver"] > 0 and row["ours_ranks"] > 0, row
        assert row["verl_driver"] is None and row["verl_ranks"] is None, row


@pytest.mark.timeout(120)
def test_soak_quick_leaves_nothing(tmp_path: Path) -> None:
    """500 non-blocking no-op calls, 50 DP_COMPUTE_PROTO calls and a 64 MiB chain, every
    future released: no task left on the scheduler, no key in worker memory (a leak is a
    bug, not a timing: the script polls for the counts to settle first)."""
    committed = BENCH / "results" / "soak_quick.json"
    before = committed.read_bytes() if committed.exists() else None
    started = time.time()
    proc = run_script("soak.py", "--quick", timeout=100)  # no --out: a quick run's default
    written = BENCH / "results" / "scratch" / "soak_quick.json"
    assert written.stat().st_mtime >= started - 1, "the quick run did not write into scratch/"
    after = committed.read_bytes() if committed.exists() else None
    assert after == before, "a quick run rewrote the committed results/soak_quick.json"
    result = json.loads(written.read_text())
    assert result["meta"]["quick"] is True
    assert result["initial"]["scheduler_tasks"] == 0
    left = json.dumps(result["leftovers"], indent=1)[:3000]
    assert result["tasks_left"] == 0, f"scheduler tasks left behind: {left}"
    assert result["keys_left"] == 0, f"keys left in worker memory: {left}"
    assert result["client_futures_left"] == 0, f"futures still held by the driver: {left}"
    assert {r["process"] for r in result["rss"]} >= {"driver"}
    assert len(result["rss"]) == 1 + result["n_workers"]
    for row in result["rss"]:
        assert row["start_mib"] > 0 and row["end_mib"] > 0, row
    assert result["chains"] >= 2  # the warm-up's and the soak's
    assert "keys left in worker memory" in proc.stdout


def test_partial_runs_default_to_the_ignored_scratch_folder() -> None:
    """Trying a script must not rewrite the committed figures that the docs quote."""
    full = run_script("bench_gpu.py", "--dry-run").stdout
    assert f"JSON to {BENCH / 'results' / 'gpu.json'}" in full
    cpu = run_script("bench_gpu.py", "--dry-run", "--cpu").stdout
    assert f"JSON to {BENCH / 'results' / 'scratch' / 'gpu.json'}" in cpu
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "benchmarks/results/scratch/soak_quick.json"],
        cwd=BENCH.parent,
    )
    assert ignored.returncode in (0, 128), "benchmarks/results/scratch/ must be git-ignored"
