"""Which values travel inside a direct-path message as they are.

Dask's serializers (type dispatch, the pickle family's checks, sub-frames) cost tens of
microseconds per value, even for an empty tuple; msgpack writes a number or a short
string in well under one. Control calls (``init_model()``, ``save(path)``, ``step(3)``)
carry only such values and most return ``None`` or a number, so they skip Dask's
serializers on both legs. Only types msgpack gives back unchanged qualify: a tuple
would come back as a list and an ``IntEnum`` as an ``int``, so those go through Dask.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_plain", "plain_call"]

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what msgpack can write
_STR_MAX = 1 << 16


def is_plain(value: Any) -> bool:
    """``value`` is ``None``, a ``bool``, ``float``, a 64-bit ``int`` or a short UTF-8 ``str``."""
    kind = type(value)
    if value is None or kind is bool or kind is float:
        return True
    if kind is int:
        return _INT_MIN <= value <= _INT_MAX
    if kind is str:
        return len(value) <= _STR_MAX and (value.isascii() or _encodes(value))
    return False


def plain_call(args: Any, kwargs: Any) -> bool:
    """Every positional and keyword argument of a call is plain."""
    return (
        type(args) is tuple
        and type(kwargs) is dict
        and all(is_plain(a) for a in args)
        and all(type(k) is str and is_plain(v) for k, v in kwargs.items())
    )


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # lone surrogates: msgpack would fail on the event loop
        return False
    return True
