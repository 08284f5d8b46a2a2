"""Backends by name: the ``hybridflow_dask.backends`` entry-point group.

A package makes its backend available to ``hybridflow-dask demo --backend NAME``,
``run_demo(backend=NAME)`` and :func:`open_backend` by declaring an entry point, the way
Dask finds ``sizeof`` functions and comm backends::

    [project.entry-points."hybridflow_dask.backends"]
    tiny = "tiny_backend_pkg:TinyBackend"

The object named is a factory: called with keyword arguments (``address=`` when the user
gives one), it returns a backend (the contract in ``backends/base.py``). This package
registers its own ``local``, ``dask`` and ``ray`` the same way, so none is special.
Listing the names reads installed packages' metadata only; a backend's module is
imported when it is opened.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["ENTRY_POINT_GROUP", "available_backends", "backend_factory", "open_backend"]

#: The entry-point group backends register under.
ENTRY_POINT_GROUP = "hybridflow_dask.backends"


def _registered() -> dict[str, list[importlib.metadata.EntryPoint]]:
    found: dict[str, list[importlib.metadata.EntryPoint]] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if not any(e.value == entry.value for e in found.get(entry.name, [])):
            found.setdefault(entry.name, []).append(entry)  # one package seen twice is one
    return found


def available_backends() -> list[str]:
    """The names of the installed backends, sorted: what ``--backend`` accepts."""
    return sorted(_registered())


def _origin(entry: importlib.metadata.EntryPoint) -> str:
    dist = getattr(entry, "dist", None)
    package = f", from {dist.name} {dist.version}" if dist is not None else ""
    return f"{entry.value}{package}"


def backend_factory(name: str) -> Callable[..., Any]:
    """The factory registered as ``name``, imported now.

    An unknown name is a ``ValueError`` that lists the installed ones; a name two packages
    register is a ``ValueError`` naming both; a factory whose module does not import
    (a missing optional dependency) is an ``ImportError`` that says which backend it was.
    """
    if not isinstance(name, str):
        raise TypeError(f"a backend name must be a str, got {type(name).__name__}")
    registered = _registered()
    entries = registered.get(name)
    if not entries:
        installed = ", ".join(sorted(registered)) or "none"
        raise ValueError(
            f"unknown backend {name!r}; installed backends: {installed} (a package adds one "
            f'under the entry-point group "{ENTRY_POINT_GROUP}")'
        )
    if len(entries) > 1:
        raise ValueError(
            f"backend {name!r} is registered more than once: "
            f"{'; '.join(_origin(e) for e in entries)}; uninstall all but one"
        )
    (entry,) = entries
    try:
        factory = entry.load()
    except ImportError as exc:
        raise ImportError(f"backend {name!r} ({_origin(entry)}) cannot be imported: {exc}") from exc
    if not callable(factory):
        raise TypeError(
            f"backend {name!r} ({_origin(entry)}) names a {type(factory).__name__}, not a "
            "factory: the entry point must name a class or function that returns a backend"
        )
    return factory


def open_backend(name: str, **kwargs: Any) -> Any:
    """A new backend made by the factory registered as ``name``, called with ``kwargs``.

    A keyword the factory does not take is a ``TypeError`` naming the backend and the
    keywords it does take (``--address`` given to a backend that attaches to nothing).
    The caller owns the backend: ``shutdown()`` it when done.
    """
    factory = backend_factory(name)
    accepted = _keywords(factory)
    unknown = [] if accepted is None else sorted(set(kwargs) - accepted)
    if unknown:
        takes = f"it takes {', '.join(sorted(accepted))}" if accepted else "it takes none"
        raise TypeError(f"backend {name!r} does not take {', '.join(unknown)} ({takes})")
    return factory(**kwargs)


def _keywords(factory: Callable[..., Any]) -> set[str] | None:
    """The keywords ``factory`` accepts; ``None`` (any) when it takes ``**kwargs`` or its
    signature cannot be read."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
