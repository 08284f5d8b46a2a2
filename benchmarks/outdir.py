"""Where a benchmark writes its JSON (and PNG) when ``--out`` is not given.

``benchmarks/results/`` holds the committed runs that the documentation quotes. Only a
run with the settings of such a run writes there by default; any other run (``--quick``,
a subset of cases, a side skipped, CPU stand-ins) writes into ``benchmarks/results/
scratch/``, which git ignores, so trying a script or running the smoke tests never
rewrites a committed figure. ``--out`` puts a run wherever it is asked to.
"""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SCRATCH = RESULTS / "scratch"


def results_dir(out: Path | None, *, trial: bool) -> Path:
    """``out`` if given, else ``results/`` for a full run and ``results/scratch/`` for a
    trial one; created if missing."""
    folder = out if out is not None else (SCRATCH if trial else RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    return folder
