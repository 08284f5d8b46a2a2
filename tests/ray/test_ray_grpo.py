"""The GRPO demo on RayBackend: the same driver code as on Dask, one argument apart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'hybridflow-dask[ray]')")

from hybridflow_dask.backends import ray as ray_package
from hybridflow_dask.cli import main
from hybridflow_dask.examples.grpo import run_demo
from hybridflow_dask.examples.grpo.report import learning_summary

#: Steps of the learning run: the reward has clearly left its start by then (about
#: 0.12 over steps 1-5 and 0.3 over steps 26-30 with seed 0; 0.99 by step 55).
LEARN_STEPS = 30


class Borrowed:
    """The session's backend as the demo's own ``RayBackend``: the same Ray and slot actors
    (no new processes to start), and a ``shutdown`` that leaves them to the session."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def __enter__(self) -> Borrowed:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_hybridflow_dask_demo_backend_ray_learns(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, ray_backend: Any
) -> None:
    made: list[Any] = []

    def ray_backend_for_the_demo(address: str | None = None) -> Borrowed:
        made.append(address)
        return Borrowed(ray_backend)

    monkeypatch.setattr(ray_package, "RayBackend", ray_backend_for_the_demo)
    out = tmp_path / "demo"
    assert main(["demo", "--backend", "ray", "--steps", str(LEARN_STEPS), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert made == [None], "--backend ray did not make a RayBackend (without an address)"
    assert "Ray backend:" in printed and "Dask dashboard" not in printed
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    assert [s["step"] for s in steps] == list(range(1, LEARN_STEPS + 1))
    summary = learning_summary(steps)
    assert summary["last5_reward"] > summary["first5_reward"] + 0.1, summary


def test_ddp_keeps_ray_ranks_identical_after_updates(ray_backend: Any) -> None:
    result = run_demo(3, world_size=2, seed=0, backend=ray_backend)
    rank0, rank1 = result["param_checksums"]
    assert rank0 == rank1, "the ranks' gradients were not all-reduced over gloo"
    assert rank0 != result["initial_checksum"], "the updates did not change the weights"


def test_the_fault_drill_recovers_a_killed_ray_rank(ray_backend: Any, tmp_path: Path) -> None:
    result = run_demo(
        4,
        world_size=2,
        seed=0,
        backend=ray_backend,
        checkpoint_every=2,
        checkpoint_dir=tmp_path,
        kill_worker_at=3,
    )
    assert [r["step"] for r in result["recoveries"]] == [3]
    assert result["recoveries"][0]["ranks"] == [1]
    assert [s["step"] for s in result["steps"]] == [1, 2, 3, 4]
    rank0, rank1 = result["param_checksums"]
    assert rank0 == rank1, "the rebuilt rank did not rejoin the process group"
