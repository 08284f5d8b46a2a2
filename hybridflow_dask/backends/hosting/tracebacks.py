"""The traceback text a driver sees for an exception raised in a rank's method.

Two things stand between a user and their own code in a plain ``format_exception`` made
where the instance lives:

- A class defined in the driver's ``__main__`` reaches the workers pickled by value
  (cloudpickle), and cloudpickle names every code object it rebuilds
  ``"<dynamic-code>"``. The rebuilt functions keep the driver module's ``__file__`` in
  their globals, so each such frame is named after that file again (line numbers are
  kept as they were).
- The first frames are the library's hosting machinery (the instance's thread, its event
  loop, the call's bookkeeping), the same few on every error. They are left out as Dask
  leaves out its own frames (``admin.traceback.shorten``): frames whose file matches
  :data:`HOSTING_FRAMES` or Dask's list are dropped, except the last frame, which is
  always kept.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Any

__all__ = ["HOSTING_FRAMES", "remote_traceback"]

#: Files of frames that only carry a call to the user's method: this package's hosting
#: code (``backends/``) and the standard library's thread, loop and future plumbing.
HOSTING_FRAMES = (
    r"hybridflow_dask[\\/]backends[\\/]",
    r"[\\/]asyncio[\\/]",
    r"[\\/]concurrent[\\/]futures[\\/]",
    r"[\\/]threading\.py",
)

#: What cloudpickle names the code of functions it rebuilt (pickled by value).
DYNAMIC_CODE = "<dynamic-code>"


def remote_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as text, with its causes and contexts, naming the user's files
    and lines and without the library's hosting frames (see the module docstring)."""
    summary = traceback.TracebackException(type(exc), exc, exc.__traceback__, lookup_lines=False)
    _rewrite(summary, exc, _library_pattern(), set())
    return "".join(summary.format())


def _library_pattern() -> re.Pattern[str]:
    paths = list(HOSTING_FRAMES)
    try:  # Dask's own list, as its users have configured it
        import dask

        paths += list(dask.config.get("admin.traceback.shorten", default=[]) or [])
    except Exception:  # dask missing or its setting malformed: ours alone still help
        pass
    return re.compile(".*(" + "|".join(paths) + ")")


def _rewrite(
    summary: traceback.TracebackException,
    exc: BaseException | None,
    library: re.Pattern[str],
    seen: set[int],
) -> None:
    """Rename and trim the frames of ``summary`` (made from ``exc``), and of every
    exception chained to it, walking both structures side by side."""
    if exc is None or id(summary) in seen:
        return
    seen.add(id(summary))
    frames = [frame for frame, _ in _walk(exc.__traceback__)]
    if len(frames) == len(summary.stack):
        named = [_named(entry, frame) for entry, frame in zip(summary.stack, frames)]
        kept = [
            entry
            for index, entry in enumerate(named)
            if index == len(named) - 1 or not library.match(entry.filename)
        ]
        summary.stack = traceback.StackSummary.from_list(kept)
    if summary.__cause__ is not None:
        _rewrite(summary.__cause__, exc.__cause__, library, seen)
    if summary.__context__ is not None:
        _rewrite(summary.__context__, exc.__context__, library, seen)
    members = getattr(summary, "exceptions", None) or []
    for member_summary, member in zip(members, getattr(exc, "exceptions", ()) or ()):
        _rewrite(member_summary, member, library, seen)


def _walk(tb: TracebackType | None) -> Iterator[tuple[FrameType, int]]:
    return traceback.walk_tb(tb)


def _named(entry: traceback.FrameSummary, frame: FrameType) -> traceback.FrameSummary:
    """``entry`` as it is, or renamed after the driver's file for rebuilt code."""
    if entry.filename != DYNAMIC_CODE:
        return entry
    real = frame.f_globals.get("__file__")
    if not isinstance(real, str) or not real:
        return entry
    renamed = traceback.FrameSummary(real, entry.lineno, entry.name, lookup_line=False)
    for position in ("end_lineno", "colno", "end_colno"):  # Python 3.11+: the carets
        value: Any = getattr(entry, position, None)
        if value is not None:
            setattr(renamed, position, value)
    return renamed
