"""``hybridflow-dask``: run the GRPO demo, or show what this machine offers.

``hybridflow-dask demo`` starts (or attaches to) a Dask cluster, prints its dashboard
link (``--backend ray``: a Ray instance, or the Ray cluster at ``--address``; the same
driver code), trains the toy GRPO policy with a live progress bar, prints a table and writes
``metrics.json`` and ``reward.png``; ``--checkpoint-every K`` saves the policy to
``--out`` and makes the run survive a lost worker, and ``--kill-worker-at STEP`` kills
one to show it. ``hybridflow-dask info`` prints the local cluster the backend would
start and the versions that matter. ``rich`` and ``matplotlib`` make the output nicer
but are optional.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, TextIO

from .backends.registry import available_backends

__all__ = ["main"]

logger = logging.getLogger(__name__)

VERSIONED = ("hybridflow-dask", "dask", "distributed", "torch", "tensordict", "ray")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hybridflow-dask`` console script; returns the exit status."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(f"unrecognized argument{'s' * (len(extra) > 1)}: {' '.join(extra)}")
    if args.command is None:
        parser.error("choose a command: demo or info")
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.verbose:
        logging.getLogger("hybridflow_dask").setLevel(logging.INFO)
    if args.command == "info":
        return _info(sys.stdout)
    return _demo(args, parser)


class _Parser(argparse.ArgumentParser):
    """argparse, with every usage error on one line that says where to look."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hybridflow-dask",
        description="HybridFlow's single-controller model on Dask distributed.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log hybridflow_dask at INFO")
    sub = parser.add_subparsers(dest="command", metavar="{demo,info}")
    demo = sub.add_parser(
        "demo",
        help="train a tiny policy with GRPO on fused actor_rollout_ref + reward workers",
        description="GRPO on a toy task (reverse a short prompt) with torch.distributed "
        "(gloo) data parallelism across Dask worker processes.",
    )
    demo.add_argument(
        "--steps", type=_positive, default=60, metavar="N", help="GRPO steps (default 60)"
    )
    demo.add_argument(
        "--workers",
        type=_positive,
        default=2,
        metavar="N",
        help="data-parallel ranks (default 2)",
    )
    demo.add_argument(
        "--backend",
        default="dask",
        metavar="NAME",
        help="where the ranks run: any installed backend (now: "
        f"{', '.join(available_backends()) or 'none'}); dask: worker processes (default), "
        "ray: Ray actors (needs the 'ray' extra), local: this process (--workers 1); "
        "the driver code is the same",
    )
    demo.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="scheduler address of a running Dask cluster, e.g. tcp://10.0.0.5:8786 (with "
        "--backend ray: a Ray cluster's, e.g. auto or ray://10.0.0.5:10001); default: "
        "start a local one",
    )
    demo.add_argument(
        "--out", type=Path, default=Path("out/demo"), help="output folder (default out/demo)"
    )
    demo.add_argument(
        "--seed", type=_whole, default=0, help="seed of prompts, weights, sampling (default 0)"
    )
    demo.add_argument(
        "--checkpoint-every",
        type=_positive,
        default=None,
        metavar="K",
        help="save the policy to OUT/checkpoint.pt at the start and every K steps, and "
        "survive a lost worker: rebuild its ranks, reload the checkpoint, rerun the step",
    )
    demo.add_argument(
        "--kill-worker-at",
        type=_positive,
        default=None,
        metavar="STEP",
        help="fault drill: SIGKILL the last rank's worker process during STEP "
        "(needs --checkpoint-every; workers on this machine)",
    )
    sub.add_parser("info", help="backend choice, versions and GPUs of this machine")
    return parser


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _address(text: str) -> str:
    from .backends.dask.driver.connect import validate_address

    try:
        return validate_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---- demo ----------------------------------------------------------------------------


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.backend not in available_backends():  # before importing torch: a quick answer
        installed = ", ".join(available_backends()) or "none"
        parser.error(
            f"argument --backend: unknown backend {args.backend!r}; installed: {installed}"
        )
    from .examples.grpo import GRPOConfig, UnsuitableBackendError, run_demo
    from .examples.grpo.report import plot_rewards, write_metrics

    config = GRPOConfig(seed=args.seed)
    try:
        config.validate(args.workers)
    except ValueError as exc:
        parser.error(f"--workers {args.workers}: {exc}")
    if args.kill_worker_at is not None:
        if args.checkpoint_every is None:
            parser.error("--kill-worker-at needs --checkpoint-every (a checkpoint to restore)")
        if args.kill_worker_at > args.steps:
            parser.error(f"--kill-worker-at {args.kill_worker_at} is after the last step")
    if args.address is not None and args.backend == "dask":
        try:
            args.address = _address(args.address)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"argument --address: {exc}")
    _quiet_dask()
    started = time.perf_counter()
    backend = _start_backend(args, parser.prog)
    if backend is None:
        return 2
    try:
        _announce(backend)
        with _progress(args.steps) as progress:
            try:
                result = run_demo(
                    args.steps,
                    world_size=args.workers,
                    backend=backend,
                    config=config,
                    on_step=progress.update,
                    checkpoint_every=args.checkpoint_every,
                    checkpoint_dir=args.out,
                    kill_worker_at=args.kill_worker_at,
                )
            except KeyboardInterrupt:
                print("interrupted; workers shut down", file=sys.stderr)
                return 130
            except UnsuitableBackendError as exc:  # e.g. two ranks in one process
                print(f"{parser.prog} demo: error: {exc}", file=sys.stderr)
                return 2
    finally:
        backend.shutdown()
    wall_s = time.perf_counter() - started
    steps = result["steps"]
    _print_table(steps)
    metrics_path = write_metrics(result, args.out, wall_s)
    png_path = plot_rewards(steps, args.out, result["recoveries"])
    print(
        f"reward: {reward_change(steps)}; {len(steps)} steps on {args.workers} ranks in "
        f"{wall_s:.1f}s (mean step {sum(s['time_s'] for s in steps) / len(steps):.2f}s); "
        f"{recovery_summary(result['recoveries'])}"
    )
    print(f"wrote {metrics_path}" + (f" and {png_path}" if png_path else ""))
    return 0


def _start_backend(args: argparse.Namespace, prog: str) -> Any:
    """The backend ``--backend`` names (attached to ``--address``), or ``None`` after
    printing one line on why it could not start."""
    from .backends.registry import open_backend

    where = f" at {args.address}" if args.address else ""
    try:
        if args.address is None:
            return open_backend(args.backend)
        return open_backend(args.backend, address=args.address)
    except ImportError as exc:  # a missing optional dependency (ray: the 'ray' extra)
        hint = " (pip install 'hybridflow-dask[ray]')" if args.backend == "ray" else ""
        print(f"{prog} demo: error: {exc}{hint}", file=sys.stderr)
    except TypeError as exc:  # --address for a backend that attaches to nothing
        print(f"{prog} demo: error: {exc}", file=sys.stderr)
    except ConnectionError as exc:  # SchedulerUnreachableError: names the address
        print(f"{prog} demo: error: {_first_line(exc)}", file=sys.stderr)
    except (ValueError, RuntimeError) as exc:
        label = "no Ray cluster" if args.backend == "ray" else f"backend {args.backend!r}"
        print(f"{prog} demo: error: {label}{where}: {_first_line(exc)}", file=sys.stderr)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def _announce(backend: Any) -> None:
    """Where to watch the run: the Dask dashboard, what Ray the ranks run on, or just
    which backend (one without a dashboard)."""
    if backend.name == "ray":
        print(f"Ray backend:    {backend.describe()}", flush=True)
        return
    link = getattr(backend, "dashboard_link", None)
    if link is None:
        print(f"backend:        {backend.name} (no dashboard)", flush=True)
        return
    print(f"Dask dashboard: {link}", flush=True)
    groups_page = getattr(backend, "groups_page", None)
    if groups_page is not None:
        print(f"worker groups:  {groups_page}", flush=True)


def recovery_summary(recoveries: list[dict[str, Any]]) -> str:
    """``"1 recovery (step 8: rank 1 rebuilt, 3.4s)"``, or ``"0 recoveries"``."""
    n = len(recoveries)
    text = f"{n} recover{'y' if n == 1 else 'ies'}"
    if not recoveries:
        return text
    parts = []
    for r in recoveries:
        ranks = ", ".join(map(str, r["ranks"]))
        parts.append(
            f"step {r['step']}: rank{'s' * (len(r['ranks']) > 1)} {ranks} rebuilt, "
            f"{r['seconds']:.1f}s"
        )
    return f"{text} ({'; '.join(parts)})"


def reward_change(steps: list[dict[str, Any]], window: int = 5) -> str:
    """``"steps 1-5 0.117 -> steps 56-60 0.995"``: naming the steps actually averaged.

    Short runs average fewer steps so the two ends never overlap.
    """
    rewards = [s["reward_mean"] for s in steps]
    n = len(rewards)
    if n == 1:
        return f"step 1 {rewards[0]:.3f}"
    w = min(window, n // 2)

    def span(lo: int, hi: int) -> str:
        return f"step {lo}" if lo == hi else f"steps {lo}-{hi}"

    first, last = sum(rewards[:w]) / w, sum(rewards[-w:]) / w
    return f"{span(1, w)} {first:.3f} -> {span(n - w + 1, n)} {last:.3f}"


def _quiet_dask() -> None:
    """Keep cluster chatter out of the demo's output (the dashboard shows it all)."""
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")  # spawned workers read it
    logging.getLogger("distributed").setLevel(logging.WARNING)


def _progress(total: int) -> Any:
    try:
        return _RichProgress(total)
    except ImportError:
        return _PlainProgress(total, sys.stderr)


class _RichProgress:
    """A rich progress bar on stderr with the live mean reward."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self._task = self._bar.add_task("starting workers", total=total, reward="-")

    def __enter__(self) -> _RichProgress:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(*exc)

    def update(self, record: dict[str, Any]) -> None:
        self._bar.update(
            self._task,
            advance=1,
            description="GRPO",
            reward=f"{record['reward_mean']:.3f}",
        )


class _PlainProgress:
    """``step 12/60 [#####-----] reward 0.431``: redrawn in place on a terminal."""

    WIDTH = 24

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total = total
        self.stream = stream
        self.start = time.perf_counter()
        self.tty = stream.isatty()

    def __enter__(self) -> _PlainProgress:
        print("starting workers ...", file=self.stream, flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tty:
            print(file=self.stream, flush=True)

    def update(self, record: dict[str, Any]) -> None:
        step = record["step"]
        filled = self.WIDTH * step // self.total
        line = (
            f"step {step}/{self.total} [{'#' * filled}{'-' * (self.WIDTH - filled)}] "
            f"reward {record['reward_mean']:.3f} loss {record['loss']:+.4f} "
            f"{time.perf_counter() - self.start:.0f}s"
        )
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=self.stream)
        self.stream.flush()


def _table_rows(steps: list[dict[str, Any]], max_rows: int = 12) -> list[dict[str, Any]]:
    """About ``max_rows`` evenly spaced steps, always the first and the last."""
    if len(steps) <= max_rows:
        return steps
    stride = -(-len(steps) // (max_rows - 1))
    picked = steps[::stride]
    return picked if picked[-1] is steps[-1] else [*picked, steps[-1]]


def _print_table(steps: list[dict[str, Any]]) -> None:
    columns = [
        ("step", "{:d}"),
        ("reward_mean", "{:.3f}"),
        ("solved", "{:.3f}"),
        ("loss", "{:+.4f}"),
        ("kl", "{:.4f}"),
        ("time_s", "{:.2f}"),
    ]
    rows = [[fmt.format(s[key]) for key, fmt in columns] for s in _table_rows(steps)]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(key), *(len(r[i]) for r in rows)) for i, (key, _) in enumerate(columns)]
        print("  ".join(key.rjust(w) for (key, _), w in zip(columns, widths)))
        for row in rows:
            print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
        return
    table = Table(title="GRPO demo")
    for key, _ in columns:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


# ---- info ----------------------------------------------------------------------------


def _info(out: TextIO) -> int:
    from .backends.dask.driver.cluster import probe_local_cluster

    choice = probe_local_cluster()
    print(f"backend: DaskBackend() would start a {choice.kind} ({choice.reason})", file=out)
    print("versions:", file=out)
    for name in VERSIONED:
        print(f"  {name:<16} {_version(name)}", file=out)
    print(f"GPUs: {_gpus(choice.gpus)}", file=out)
    return 0


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gpus(nvml_count: int) -> str:
    """What torch sees, asked only where there may be a GPU: importing torch takes seconds."""
    if nvml_count == 0 and not _nvidia_driver():
        return "none (no NVIDIA driver on this machine)"
    try:
        import torch
    except ImportError:
        return f"{nvml_count} seen by NVML; torch is not installed"
    if not torch.cuda.is_available():
        return f"none seen by torch (CUDA unavailable); {nvml_count} seen by NVML"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} seen by torch: " + ", ".join(f"cuda:{i} {n}" for i, n in enumerate(names))


def _nvidia_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia") or shutil.which("nvidia-smi") is not None
