"""The GRPO demo end to end on the Dask backend, its pieces, and the CLI around it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from hybridflow_dask.cli import main
from hybridflow_dask.examples.grpo import (
    GRPOConfig,
    ReverseTask,
    group_relative_advantages,
    run_demo,
)
from hybridflow_dask.examples.grpo.report import learning_summary, plot_rewards, write_metrics


@pytest.fixture(scope="module")
def short_run(hf_dask_backend):
    """Three GRPO steps on two ranks of the session cluster (a few seconds)."""
    return run_demo(3, world_size=2, seed=0, backend=hf_dask_backend)


def test_short_run_reports_every_step(short_run):
    steps = short_run["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert 0.0 <= s["reward_mean"] <= 1.0
        assert 0.0 <= s["solved"] <= 1.0
        assert math.isfinite(s["loss"])
        assert s["time_s"] > 0
    assert short_run["config"]["world_size"] == 2


def test_ddp_keeps_ranks_identical_after_updates(short_run):
    # The ranks trained on different shards; only all-reduced gradients keep them equal.
    rank0, rank1 = short_run["param_checksums"]
    assert rank0 == rank1
    assert rank0 != short_run["initial_checksum"], "the updates did not change the weights"


def test_metrics_json_and_plot(short_run, tmp_path):
    path = write_metrics(short_run, tmp_path, wall_s=1.0)
    saved = json.loads(path.read_text())
    assert [s["step"] for s in saved["steps"]] == [1, 2, 3]
    assert {"step", "reward_mean", "loss", "time_s"} <= set(saved["steps"][0])
    pytest.importorskip("matplotlib")
    assert plot_rewards(short_run["steps"], tmp_path).stat().st_size > 0
    assert set(learning_summary(short_run["steps"])) == {"first5_reward", "last5_reward"}


def test_group_relative_advantages_normalize_within_each_group():
    scores = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.2, 0.4])
    uids = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    adv = group_relative_advantages(scores, uids, group_size=2)
    assert torch.allclose(adv.view(3, 2).sum(1), torch.zeros(3), atol=1e-6)
    assert adv[0] < 0 < adv[1]
    assert torch.equal(adv[2:4], torch.zeros(2))  # equal scores: no signal, no NaN


def test_group_split_across_ranks_is_an_error():
    scores = torch.tensor([0.0, 1.0, 0.5])
    with pytest.raises(ValueError, match="whole groups"):
        group_relative_advantages(scores, np.array(["a", "a", "b"], dtype=object), group_size=2)


def test_reverse_task_reward():
    task = ReverseTask(num_symbols=4, prompt_len=3)
    prompts = torch.tensor([[0, 1, 2], [3, 3, 1]])
    responses = torch.tensor([[2, 1, 0], [1, 0, 0]])
    assert task.reward(prompts, responses).tolist() == [1.0, pytest.approx(1 / 3)]


def test_config_rejects_groups_split_across_ranks():
    with pytest.raises(ValueError, match="divisible"):
        GRPOConfig(prompts_per_step=6).validate(4)


def test_cli_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "would start a" in out
    for name in ("hybridflow-dask", "dask", "distributed", "torch", "tensordict"):
        assert name in out
    assert "GPUs:" in out


def test_cli_demo_rejects_bad_worker_count_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--workers", "3"])
    assert exc.value.code == 2
    assert "divisible" in capsys.readouterr().err


@pytest.mark.cluster
def test_cli_demo_survives_a_killed_worker_and_still_learns(tmp_path, capsys):
    """The fault drill end to end: rank 1's process is SIGKILLed in step 12 of 30; the run
    rebuilds it, reloads the step-10 checkpoint on both ranks and finishes every step.

    The CLI starts its own local cluster, so the kill never touches the session cluster.
    About 20-30 s on 2 cores (start-up, ~4 s of recovery, 30 short steps).
    """
    out = tmp_path / "drill"
    args = ["demo", "--steps", "30", "--checkpoint-every", "5", "--kill-worker-at", "12"]
    assert main([*args, "--out", str(out)]) == 0
    assert "; 1 recovery (step 12: rank 1 rebuilt" in capsys.readouterr().out
    saved = json.loads((out / "metrics.json").read_text())
    assert [s["step"] for s in saved["steps"]] == list(range(1, 31))
    [recovery] = saved["recoveries"]
    assert set(recovery) == {"step", "ranks", "seconds"}
    assert recovery["step"] == 12 and recovery["ranks"] == [1]
    assert 0 < recovery["seconds"] < 60
    assert saved["config"]["checkpoint_every"] == 5 and saved["config"]["kill_worker_at"] == 12
    assert (out / "checkpoint.pt").stat().st_size > 0
    rewards = [s["reward_mean"] for s in saved["steps"]]
    for r in rewards:
        assert 0.0 <= r <= 1.0 and math.isfinite(r)
    # the default run climbs from ~0.12 (steps 1-5) to ~0.27 (steps 26-30): loose margin
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.05, f"no learning after the recovery: {first:.3f} -> {last:.3f}"


def test_cli_demo_rejects_a_drill_it_cannot_run_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--kill-worker-at", "3"])
    assert exc.value.code == 2
    assert "needs --checkpoint-every" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--steps", "5", "--checkpoint-every", "2", "--kill-worker-at", "6"])
    assert exc.value.code == 2
    assert "after the last step" in capsys.readouterr().err


def test_run_demo_checks_the_drill_arguments():
    with pytest.raises(ValueError, match="needs checkpoint_every"):
        run_demo(3, kill_worker_at=2)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        run_demo(3, checkpoint_every=1)
    with pytest.raises(ValueError, match="kill_rank"):
        run_demo(3, checkpoint_every=1, checkpoint_dir=".", kill_worker_at=2, kill_rank=2)
