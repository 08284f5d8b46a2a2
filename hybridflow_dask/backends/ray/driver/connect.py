"""Reaching a Ray cluster: an address that answers, and what the slot actors import."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ....errors import SchedulerUnreachableError

__all__ = ["CONNECT_WAIT_S", "check_answers", "with_driver_paths"]

#: How long ``RayBackend(address=...)`` waits for the address to accept a connection.
CONNECT_WAIT_S = 5.0


def check_answers(address: str, timeout: float = CONNECT_WAIT_S) -> None:
    """A ``HOST:PORT`` (or ``ray://HOST:PORT``) where nothing listens is a
    ``ConnectionError`` within ``timeout``: ``ray.init`` would retry for minutes."""
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" and the like: Ray looks for the cluster itself
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        why = str(exc.strerror or exc)
        raise SchedulerUnreachableError(
            address,
            timeout,
            why,
            f"no Ray cluster answers at {address} ({why}); start its head with `ray start "
            "--head`, or give the address it printed",
        ) from None


def with_driver_paths(runtime_env: Mapping[str, Any] | None) -> dict[str, Any]:
    """``runtime_env`` whose ``PYTHONPATH`` also lists the driver's own import folders
    (its script's, the working directory, what pytest or the program added), so the
    slot actors import worker classes from the same modules, as Dask's spawned workers
    do; a ``PYTHONPATH`` given in ``runtime_env`` is kept as it is."""
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    if "PYTHONPATH" not in env_vars:
        prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
        paths = []
        for entry in sys.path:
            path = os.path.realpath(entry or os.getcwd())
            installed = any(path.startswith(p + os.sep) for p in prefixes) or any(
                part in ("site-packages", "dist-packages") for part in Path(path).parts
            )  # the hosts' own interpreter has its packages: never put others first
            if os.path.isdir(path) and not installed:
                paths.append(path)
        inherited = os.environ.get("PYTHONPATH", "")
        joined = os.pathsep.join(
            dict.fromkeys([*paths, *filter(None, inherited.split(os.pathsep))])
        )
        if joined:
            env_vars["PYTHONPATH"] = joined
    if env_vars:
        env["env_vars"] = env_vars
    return env
