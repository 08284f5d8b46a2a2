"""What a demo run leaves behind: ``metrics.json``, ``reward.png`` and a one-line summary."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from statistics import fmean
from typing import Any

__all__ = ["learning_summary", "plot_rewards", "write_metrics"]

logger = logging.getLogger(__name__)


def write_metrics(result: dict[str, Any], out_dir: Path, wall_s: float | None = None) -> Path:
    """``out_dir/metrics.json``: ``{"steps": [{"step", "reward_mean", "loss", "time_s", ...}],
    "recoveries": [{"step", "ranks", "seconds"}, ...], "config": ..., "wall_s": ...}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"steps": result["steps"]}
    payload["recoveries"] = result.get("recoveries", [])
    if "config" in result:
        payload["config"] = result["config"]
    if wall_s is not None:
        payload["wall_s"] = wall_s
    path = out_dir / "metrics.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def plot_rewards(
    steps: list[dict[str, Any]], out_dir: Path, recoveries: list[dict[str, Any]] | None = None
) -> Path | None:
    """``out_dir/reward.png`` (mean reward and solved fraction per step), if matplotlib is there.

    Each of ``recoveries`` (``{"step", ...}``) is a dotted vertical line at its step.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: skipping reward.png (pip install matplotlib)")
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    xs = [s["step"] for s in steps]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(xs, [s["reward_mean"] for s in steps], label="mean reward")
    if all("solved" in s for s in steps):
        ax.plot(xs, [s["solved"] for s in steps], label="solved fraction", alpha=0.7)
    for i, recovery in enumerate(recoveries or []):
        label = "worker lost, recovered" if i == 0 else None
        ax.axvline(recovery["step"], color="tab:red", linestyle=":", label=label)
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1.05)
    ax.set_title("hybridflow-dask GRPO demo: reverse the prompt")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = out_dir / "reward.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def learning_summary(steps: list[dict[str, Any]], window: int = 5) -> dict[str, float]:
    """Mean reward of the first and last ``window`` steps: did the policy learn?"""
    rewards = [s["reward_mean"] for s in steps]
    return {
        f"first{window}_reward": fmean(rewards[:window]),
        f"last{window}_reward": fmean(rewards[-window:]),
    }
