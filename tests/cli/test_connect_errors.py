"""A bad scheduler address fails at once and an unreachable one fast, in one line, and the
process then exits (Dask's half-made ``Client`` used to block it in ``__del__``)."""

from __future__ import annotations

import socket

import pytest

from hybridflow_dask.backends import SchedulerUnreachableError
from hybridflow_dask.backends.dask.driver.connect import validate_address

#: Correctness bounds for a loaded CI machine, not benchmarks.
PROMPT_S = 30
CONNECT_TIMEOUT = {"DASK_HYBRIDFLOW__CONNECT_TIMEOUT": "1s"}


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_malformed_address_is_one_line_and_exit_2(cli):
    ran = cli("demo", "--address", "notanaddress")
    assert ran.returncode == 2
    assert len(ran.error_lines) == 1, ran.stderr
    assert "argument --address: not a Dask scheduler address: 'notanaddress'" in ran.stderr
    assert "tcp://" in ran.stderr  # shows what an address looks like
    assert ran.seconds < PROMPT_S


def test_cli_unreachable_scheduler_is_one_line_within_the_connect_timeout(cli, closed_port):
    address = f"tcp://127.0.0.1:{closed_port}"
    ran = cli("demo", "--address", address, env=CONNECT_TIMEOUT)
    assert ran.returncode == 2
    assert len(ran.error_lines) == 1, ran.stderr
    line = ran.error_lines[0]
    assert f"no Dask scheduler answered at {address} within 1 s" in line
    assert "connection refused" in line and "hybridflow.connect-timeout" in line
    assert ran.seconds < PROMPT_S  # Dask alone waits 30 s, then prints a long traceback


PROGRAM = """
import time
from hybridflow_dask.backends import DaskBackend
started = time.perf_counter()
try:
    DaskBackend(address={address!r})
except {catch} as exc:
    print(type(exc).__name__, round(time.perf_counter() - started, 1))
"""


def test_program_malformed_address_is_a_value_error_and_exits_cleanly(program):
    ran = program(PROGRAM.format(address="notanaddress", catch="ValueError"))
    assert ran.returncode == 0, ran.stderr
    name, seconds = ran.stdout.split()
    assert name == "ValueError" and float(seconds) < 1
    assert "Exception ignored" not in ran.stderr and "Traceback" not in ran.stderr
    assert ran.seconds < PROMPT_S


def test_program_unreachable_scheduler_is_a_connection_error(program, closed_port):
    code = PROGRAM.format(address=f"127.0.0.1:{closed_port}", catch="ConnectionError")
    ran = program(code, env=CONNECT_TIMEOUT)
    assert ran.returncode == 0, ran.stderr
    name, seconds = ran.stdout.split()
    assert name == "SchedulerUnreachableError" and float(seconds) < 10
    assert "Exception ignored" not in ran.stderr and "Traceback" not in ran.stderr
    assert ran.seconds < PROMPT_S


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("notanaddress", "no port"),
        ("tcp://host", "no port"),
        ("tcp://:8786", "no host"),
        ("tcp://host:99999", "not a number from 1 to 65535"),
        ("tcp://host:87a", "not a number"),
        ("http://host:8787/status", "web URL"),
        ("foo://host:1", "unknown protocol 'foo'"),
        ("", "expected PROTOCOL://HOST:PORT"),
    ],
)
def test_malformed_addresses_say_what_is_wrong(address, why):
    with pytest.raises(ValueError, match="not a Dask scheduler address") as info:
        validate_address(address)
    assert why in str(info.value)


@pytest.mark.parametrize(
    "address",
    [
        "tcp://10.0.0.5:8786",
        "10.0.0.5:8786",
        "tls://h.example:1",
        "tcp://[::1]:8786",
        "inproc://x/1",
    ],
)
def test_well_formed_addresses_pass(address):
    assert validate_address(f"  {address} ") == address


def test_the_error_type_is_a_connection_error():
    assert issubclass(SchedulerUnreachableError, ConnectionError)
