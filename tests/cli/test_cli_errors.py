"""Usage errors of ``hybridflow-dask``: exit status 2, one line naming what is wrong, at once."""

from __future__ import annotations

import pytest

from hybridflow_dask.cli import reward_change

#: Correctness bounds for a loaded CI machine, not benchmarks (quiet: about 0.15 s).
QUICK_S = 10


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["demo", "--steps", "abc"], "argument --steps: expected a whole number of at least 1"),
        (["demo", "--steps", "0"], "argument --steps: expected a whole number of at least 1"),
        (["demo", "--workers", "-2"], "argument --workers: expected a whole number"),
        (["demo", "--seed", "x"], "argument --seed: expected a whole number, got 'x'"),
        (["--bogus"], "unrecognized argument: --bogus"),
        (["demo", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
        ([], "choose a command: demo or info"),
    ],
)
def test_usage_errors_are_one_line_naming_the_option(cli, args, expected):
    ran = cli(*args)
    assert ran.returncode == 2
    assert len(ran.error_lines) == 1, ran.stderr
    assert expected in ran.error_lines[0]
    assert "--help" in ran.error_lines[0]
    assert ran.seconds < QUICK_S


def test_help_lists_the_commands(cli):
    ran = cli("--help")
    assert ran.returncode == 0
    assert "demo" in ran.stdout and "info" in ran.stdout
    assert ran.seconds < QUICK_S


def test_info_describes_the_machine(cli):
    ran = cli("info")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("backend: DaskBackend() would start a ")
    assert "distributed" in ran.stdout and "GPUs:" in ran.stdout
    assert ran.seconds < 30


def test_reward_summary_names_the_steps_it_averaged():
    steps = [{"reward_mean": r} for r in (0.0, 0.5, 1.0)]
    assert reward_change(steps) == "step 1 0.000 -> step 3 1.000"
    steps = [{"reward_mean": r / 10} for r in range(1, 11)]
    assert reward_change(steps) == "steps 1-5 0.300 -> steps 6-10 0.800"
    steps = [{"reward_mean": 0.0}] * 5 + [{"reward_mean": 1.0}] * 55
    assert reward_change(steps) == "steps 1-5 0.000 -> steps 56-60 1.000"
    assert reward_change([{"reward_mean": 0.25}]) == "step 1 0.250"
