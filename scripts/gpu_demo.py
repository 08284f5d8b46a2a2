"""The GRPO demo with each rank's policy on its GPU: ``hybridflow-dask demo`` on CUDA.

    python scripts/gpu_demo.py [--steps 60] [--workers N] [--out DIR] [--dry-run]

Runs ``run_demo`` with ``GRPOConfig(device="cuda")`` on ``DaskBackend()`` (a
LocalCUDACluster: one worker per GPU, so ``--workers`` defaults to the GPU count), prints
the reward's change and writes ``DIR/metrics.json`` and ``DIR/reward.png``. ``--dry-run``
prints what it would run and needs no GPU; without a GPU it refuses (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workers", type=int, default=None, help="ranks (default: one per GPU)")
    parser.add_argument("--out", type=Path, default=Path("out/gpu_demo"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="print the plan; needs no GPU")
    args = parser.parse_args(argv)
    import torch

    from hybridflow_dask.examples.grpo import GRPOConfig

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    workers = args.workers or max(gpus, 1)
    config = GRPOConfig(seed=args.seed, device="cuda")
    try:
        config.validate(workers)
    except ValueError as exc:
        parser.error(f"--workers {workers}: {exc}")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    plan = (
        f"GRPO demo on CUDA: {args.steps} steps, {workers} rank(s), seed {args.seed}, to {args.out}"
    )
    if args.dry_run:
        print(f"gpu_demo plan: {plan}")
        return 0
    if not gpus:
        print(
            "gpu_demo: needs a CUDA GPU; torch sees none (--dry-run prints the plan)",
            file=sys.stderr,
        )
        return 2
    from hybridflow_dask.backends import DaskBackend
    from hybridflow_dask.cli import reward_change
    from hybridflow_dask.examples.grpo import run_demo
    from hybridflow_dask.examples.grpo.report import plot_rewards, write_metrics

    print(plan, flush=True)
    started = time.perf_counter()
    with DaskBackend() as backend:
        print(f"cluster: {backend.choice.kind if backend.choice else 'given'}", flush=True)
        result = run_demo(args.steps, world_size=workers, backend=backend, config=config)
    wall_s = time.perf_counter() - started
    steps = result["steps"]
    metrics = write_metrics(result, args.out, wall_s)
    png = plot_rewards(steps, args.out, result["recoveries"])
    mean_step = sum(s["time_s"] for s in steps) / len(steps)
    print(
        f"reward: {reward_change(steps)}; {len(steps)} steps on {workers} GPU rank(s) in "
        f"{wall_s:.1f}s (mean step {mean_step:.3f}s)"
    )
    print(f"wrote {metrics}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
