"""A rank's prints and log records on its worker's Dask log page, tagged with the rank.

Dask's worker log page (``/info/logs/<worker>.html``, linked from each rank on the group
page) lists the worker's own log records. Each instance's threads are tagged with their
rank once (``enter``); from then on, what such a thread writes to ``sys.stdout`` or
``sys.stderr`` (line by line) and the records it logs through the root logger are also
added to that list under the name ``hybridflow.<group>[<rank>]``. The output still goes
where it went before: the worker's terminal.

The streams and the root handler are installed once per worker process, by the first
instance; threads that are not an instance's pass straight through.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

__all__ = ["enter"]

_local = threading.local()
_install_lock = threading.Lock()
_installed = False
#: The longest line kept; the rest of a longer one is cut with a note.
LINE_CHARS = 10_000


def enter(label: str, worker: Any) -> None:
    """Tag this thread as rank ``label`` of ``worker``: its output goes to the worker's log."""
    _install()
    _local.label = label
    _local.logs = worker.logs
    _local.partial = {}


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        sys.stdout = _Tee(sys.stdout, logging.INFO)
        sys.stderr = _Tee(sys.stderr, logging.WARNING)
        logging.getLogger().addHandler(_RankHandler())
        _installed = True


def _add(level: int, message: str, name: str = "") -> None:
    label = _local.label
    if len(message) > LINE_CHARS:
        message = message[:LINE_CHARS] + f" ... [{len(message) - LINE_CHARS} more characters]"
    record = logging.LogRecord(
        f"hybridflow.{label}{'.' + name if name else ''}", level, "", 0, message, None, None
    )
    _local.logs.append(record)


class _Tee:
    """A text stream that also copies whole lines written by an instance's thread."""

    def __init__(self, inner: Any, level: int) -> None:
        self._inner = inner
        self._level = level

    def write(self, text: str) -> int:
        written = self._inner.write(text)
        if getattr(_local, "label", None) is not None and text:
            buffered = _local.partial.get(self._level, "") + text
            *lines, rest = buffered.split("\n")
            _local.partial[self._level] = rest
            for line in lines:
                _add(self._level, line)
        return written

    def flush(self) -> None:
        self._inner.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty, buffer, ...
        return getattr(self._inner, name)


class _RankHandler(logging.Handler):
    """Copies records logged from an instance's thread (Dask's own are already there)."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(_local, "label", None) is None or record.name.startswith("distributed"):
            return
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            _add(record.levelno, message, record.name)
        except Exception:
            self.handleError(record)
