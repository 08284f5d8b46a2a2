"""The kit as a third party runs it (``--hf-backend``, ``--pyargs``), in-process through
``pytester``: it passes a correct backend, and fails each deliberately broken one
(``conformance_doubles``) in the test for the broken guarantee, with a message that says
what is wrong."""

from __future__ import annotations

import conformance_doubles  # noqa: F401
import pytest

import hybridflow_dask.testing.conformance  # noqa: F401

# Imported here, not only inside each in-process run: pytester drops the modules a run
# imported when it ends, so every run would import torch and the package again.

pytest_plugins = ["pytester"]

KIT = (
    "--pyargs",
    "hybridflow_dask.testing.conformance",
    "-p",
    "no:cacheprovider",
    "-p",
    "no:hypothesispytest",
)


def run_kit(pytester: pytest.Pytester, backend: str, *extra: str) -> pytest.HookRecorder:
    return pytester.inline_run(*KIT, f"--hf-backend={backend}", *extra)


def failure_text(recorder: pytest.HookRecorder, test: str) -> str:
    """The failure report of ``test`` (by function name); fails if it did not fail."""
    for report in recorder.getreports("pytest_runtest_logreport"):
        if report.nodeid.endswith(f"::{test}") and report.failed:
            return report.longreprtext
    outcomes = {
        r.nodeid.rsplit("::", 1)[-1]: r.outcome
        for r in recorder.getreports("pytest_runtest_logreport")
        if r.when == "call"
    }
    pytest.fail(f"{test} did not fail; outcomes: {outcomes}")


def test_the_kit_passes_local_backend_given_on_the_command_line(pytester: pytest.Pytester):
    recorder = run_kit(pytester, "hybridflow_dask.backends.local:LocalBackend")
    passed, skipped, failed = recorder.listoutcomes()
    assert not failed, [r.nodeid for r in failed]
    assert len(passed) >= 20
    reasons = {str(r.longrepr[2]) for r in skipped}
    assert reasons and all("in_process = True" in reason for reason in reasons), reasons


def test_the_kit_says_how_to_name_a_backend_when_none_is_given(pytester: pytest.Pytester):
    recorder = pytester.inline_run(*KIT, "-k", "test_free_port_is_a_port_number")
    text = failure_text(recorder, "test_free_port_is_a_port_number")
    assert "pass --hf-backend=MODULE:FACTORY" in text


@pytest.mark.parametrize(
    ("double", "test", "message"),
    [
        (
            "ReorderingBackend",
            "test_calls_on_one_instance_run_in_issue_order",
            "calls on one instance ran out of issue order: issued 0..39, the instance ran "
            "[3, 2, 1, 0, 4, 12, 11",
        ),
        (
            "SilentLossBackend",
            "test_a_killed_worker_fails_the_next_call_with_worker_lost_error_naming_group_and_rank",
            "returned None: the worker was lost silently; it must raise WorkerLostError",
        ),
        (
            "SilentLossBackend",
            "test_alive_is_false_for_a_killed_workers_slot",
            "alive(slot) is still True for a slot whose process was killed",
        ),
        (
            "NoSnapshotBackend",
            "test_arguments_are_captured_when_the_call_is_made",
            "arguments must be captured when the call is made",
        ),
        (
            "NoSnapshotBackend",
            "test_results_are_captured_when_the_method_returns",
            "results must be captured when the method returns",
        ),
        (
            "UnannotatedErrorsBackend",
            "test_method_errors_keep_their_type_and_name_group_method_and_rank",
            "carries no note naming",
        ),
    ],
)
def test_the_kit_fails_a_broken_backend_saying_what_is_wrong(
    pytester: pytest.Pytester, double: str, test: str, message: str
):
    recorder = run_kit(pytester, f"conformance_doubles:{double}", "-k", test)
    assert message in failure_text(recorder, test)


def test_the_kit_runs_at_the_world_size_given_on_the_command_line(pytester: pytest.Pytester):
    test = "test_method_errors_keep_their_type_and_name_group_method_and_rank"
    recorder = run_kit(
        pytester,
        "conformance_doubles:UnannotatedErrorsBackend",
        "--hf-kit-world-size=5",
        "-k",
        test,
    )
    assert "fail on rank 4 carries no note naming" in failure_text(recorder, test)  # the last


def test_the_kit_refuses_a_world_size_below_two(pytester: pytest.Pytester):
    test = "test_rank_env_is_in_os_environ_in_init_and_in_every_call"
    recorder = run_kit(
        pytester, "hybridflow_dask.backends.local:LocalBackend", "--hf-kit-world-size=1", "-k", test
    )
    assert "the kit's world size must be a whole number from 2, got 1" in failure_text(
        recorder, test
    )
