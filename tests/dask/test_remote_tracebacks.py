"""A worker's error shows the user's own code: ``exc.remote_traceback`` names the user's
files and lines (also for a class defined in the driver's ``__main__``, which workers get
pickled by value) and leaves out the library's hosting frames, as Dask leaves out its own."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest

import hybridflow_dask as hf
from hybridflow_dask.backends.hosting.tracebacks import remote_traceback

HERE = Path(__file__).resolve()
HOSTING = ("hybridflow_dask/backends", "threading.py", "asyncio", "concurrent/futures")


def _reciprocal(x: float) -> float:
    return 1 / x


class Fails(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def divide(self, x):
        return _reciprocal(x)

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    async def divide_async(self, x):
        return _reciprocal(x)

    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def wrapped(self):
        try:
            _reciprocal(0)
        except ZeroDivisionError as cause:
            raise RuntimeError("could not divide") from cause


def _line_of(function, text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _frames(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]


def test_a_method_error_shows_the_users_frames_and_no_hosting_frames(
    hf_dask_backend, hf_worker_group
):
    group = hf_worker_group(Fails, [1], backend=hf_dask_backend)
    for method in (group.divide, group.divide_async):
        try:
            method(0)
        except ZeroDivisionError as exc:
            text = exc.remote_traceback
        else:
            raise AssertionError("the call should have raised")
        frames = _frames(text)
        assert frames, text
        assert all(str(HERE) in frame for frame in frames), text  # only this file's frames
        assert f'File "{HERE}", line {_line_of(_reciprocal, "1 / x")}, in _reciprocal' in text
        assert "return 1 / x" in text and text.rstrip().endswith("division by zero"), text
        assert not any(part in text for part in HOSTING), text


def test_a_chained_error_is_trimmed_in_every_part(hf_dask_backend, hf_worker_group):
    group = hf_worker_group(Fails, [1], backend=hf_dask_backend)
    try:
        group.wrapped()
    except RuntimeError as exc:
        text = exc.remote_traceback
    else:
        raise AssertionError("the call should have raised")
    assert "The above exception was the direct cause" in text, text
    assert f"line {_line_of(Fails.wrapped, 'raise RuntimeError')}, in wrapped" in text
    assert f"line {_line_of(_reciprocal, '1 / x')}, in _reciprocal" in text
    assert not any(part in text for part in HOSTING), text


DRIVER = """\
import hybridflow_dask as hf


def helper(x):
    return 1 / x  # the line the traceback must show


class Divider(hf.Worker):
    @hf.register(hf.Dispatch.ONE_TO_ALL)
    def divide(self, x):
        return helper(x)


if __name__ == "__main__":
    hf.init(n_workers=1)
    group = hf.WorkerGroup(hf.ResourcePool([1]), hf.ClassWithInitArgs(Divider))
    try:
        group.divide(0)
    except ZeroDivisionError as exc:
        print(exc.remote_traceback)
    hf.shutdown()
"""


@pytest.mark.cluster  # a driver script in a process of its own
def test_a_class_from_the_drivers_main_script_shows_that_script_and_its_lines(tmp_path):
    script = tmp_path / "my_driver.py"
    script.write_text(DRIVER)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=150, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    assert "<dynamic-code>" not in text, text
    assert f'File "{script}", line 11, in divide' in text, text
    assert f'File "{script}", line 5, in helper' in text, text
    assert "return 1 / x  # the line the traceback must show" in text, text
    assert not any(part in text for part in HOSTING), text


def test_rebuilt_code_is_named_after_its_modules_file_and_the_last_frame_is_always_kept(
    tmp_path,
):
    user_file = tmp_path / "user.py"
    user_file.write_text("def call(f):\n    return f()  # user line 2\n")
    scope: dict = {"__file__": str(user_file)}
    exec(compile(user_file.read_text(), "<dynamic-code>", "exec"), scope)  # as cloudpickle
    library: dict = {}
    exec(
        compile(
            "def fail():\n    raise KeyError('x')\n", "/x/hybridflow_dask/backends/h.py", "exec"
        ),
        library,
    )
    try:
        scope["call"](library["fail"])
    except KeyError as exc:
        text = remote_traceback(exc)
        plain = "".join(traceback.format_exception(exc))
    assert "<dynamic-code>" in plain  # what the formatter has to undo
    assert f'File "{user_file}", line 2, in call' in text and "user line 2" in text, text
    # the raising frame is a library file but the last one: kept, as Dask keeps its last
    assert 'File "/x/hybridflow_dask/backends/h.py", line 2, in fail' in text, text
    assert textwrap.dedent(text).rstrip().endswith("KeyError: 'x'")
