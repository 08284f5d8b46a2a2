"""What a WorkerGroup call's arguments must be, checked in the driver before anything is sent.

Two kinds of mistakes would otherwise fail only on the ranks, after the data travelled:
arguments the method's signature cannot take, and futures the group's backend cannot
resolve (of a backend that was shut down, or of another kind of backend). Both are
refused here with a message that says what to do instead.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from .backends.base import FutureList
from .decorators.dispatch import looks_like_future
from .protocol import DataProtoFuture

__all__ = ["check_fits", "check_inputs"]


def check_fits(cls: type, method_name: str, args: tuple, kwargs: dict) -> None:
    """A ``TypeError`` before anything is sent when the method cannot take the arguments
    (unknown or missing keywords, too many positionals, a keyword-only parameter passed
    by position), as its own call would raise on every rank."""
    if _takes(cls, method_name, len(args), tuple(kwargs)):
        return
    signature = _call_signature(cls, method_name)
    if signature is None:
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        keyword_only = [p.name for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY]
        hint = (
            f"; {', '.join(keyword_only)} can only be passed by name ({keyword_only[0]}=...)"
            if keyword_only and "positional" in str(exc)
            else ""
        )
        raise TypeError(
            f"{cls.__name__}.{method_name}{signature} cannot take these arguments: "
            f"{exc}{hint}; call it as {method_name}{signature} (nothing was sent to the "
            "workers)"
        ) from None


def check_inputs(backend: Any, label: str, world_size: int, args: tuple, kwargs: dict) -> None:
    """Futures ``backend`` cannot resolve fail before anything is sent (``label``: the
    group and method, for the message).

    Looked at: each argument, and the items of a list or tuple of ``world_size`` items
    (what a DP_COMPUTE or ALL_TO_ALL call hands out per rank): a ``DataProtoFuture`` or
    ``FutureList`` of a backend that was shut down, a future whose client was closed, and
    a future of another kind of backend (a ``LocalBackend`` future given to a Dask group,
    or the reverse), which would reach the method unresolved.
    """
    for name, value in _named_values(args, kwargs):
        problem = _future_problem(backend, value)
        per_rank = isinstance(value, (list, tuple)) and len(value) == world_size
        if problem is None and per_rank:
            problem = next((p for v in value if (p := _future_problem(backend, v))), None)
        if problem is not None:
            raise ValueError(
                f"{label}: argument {name} {problem} (nothing was sent to the workers)"
            )


def _future_problem(backend: Any, value: Any) -> str | None:
    """Why ``backend``'s groups cannot use ``value`` as a future, or ``None``."""
    mine = type(backend).__name__
    if isinstance(value, DataProtoFuture):
        if _shut_down(value.runner):
            return (
                f"is a DataProtoFuture of a {type(value.runner).__name__} that was shut "
                "down, so its rows are gone; compute them again on an open backend (or "
                "get() them before shutting their backend down)"
            )
        foreign = next((p for p in value.parts if _foreign_future(backend, p)), None)
        if foreign is not None:
            return (
                f"is a DataProtoFuture whose parts are {type(foreign).__name__}s, which "
                f"this group's {mine} cannot fetch; pass its get(), or make both groups "
                "on one backend"
            )
        return None
    if isinstance(value, FutureList) and _shut_down(value.backend):
        return (
            f"holds futures of a {type(value.backend).__name__} that was shut down, so "
            "their results are gone; compute them again on an open backend (or hf.get() "
            "them before shutting their backend down)"
        )
    if _foreign_future(backend, value):
        return (
            f"is a {type(value).__name__}, a future this group's {mine} cannot resolve; "
            "pass hf.get() of it, or make both groups on one backend"
        )
    problem = getattr(backend, "future_problem", None)  # optional (Backend's docstring)
    return problem(value) if problem is not None and backend.is_future(value) else None


def _foreign_future(backend: Any, value: Any) -> bool:
    return looks_like_future(value) and not backend.is_future(value)


@functools.lru_cache(maxsize=4096)
def _takes(cls: type, name: str, positional: int, names: tuple[str, ...]) -> bool:
    """Whether ``cls.name`` takes ``positional`` arguments and keywords ``names`` (or
    cannot be told): binding looks only at how many and which names, never at values,
    so each shape of call is bound once, not on every call."""
    signature = _call_signature(cls, name)
    if signature is None:
        return True
    try:
        signature.bind(*[None] * positional, **dict.fromkeys(names))
    except TypeError:
        return False
    return True


@functools.lru_cache(maxsize=1024)
def _call_signature(cls: type, name: str) -> inspect.Signature | None:
    """The parameters a call of ``cls.name`` fills (``self`` left out), or ``None`` when
    they cannot be told for sure: not a plain function, a signature Python cannot read,
    or ``self`` taken by ``*args``. The function's own signature, not a wrapped one's
    (``follow_wrapped=False``): a decorator's ``(*args, **kwargs)`` accepts anything,
    and a decorator that fills parameters itself must not make valid calls fail."""
    raw = inspect.getattr_static(cls, name, None)
    if isinstance(raw, staticmethod):
        fn, bound = raw.__func__, False
    elif isinstance(raw, classmethod):
        fn, bound = raw.__func__, True
    elif inspect.isfunction(raw):
        fn, bound = raw, True
    else:
        return None
    try:
        signature = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    if bound:
        if not params or params[0].kind not in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            return None
        params = params[1:]
    # Shown in messages: names and defaults say how to call it; annotations are noise.
    params = [p.replace(annotation=inspect.Parameter.empty) for p in params]
    return signature.replace(parameters=params, return_annotation=inspect.Signature.empty)


def _named_values(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    return [(f"#{i}", a) for i, a in enumerate(args)] + [(repr(k), v) for k, v in kwargs.items()]


def _shut_down(backend: Any) -> bool:
    """Whether a backend (or a ``DataProtoFuture``'s runner) was shut down, where it says."""
    return getattr(backend, "closed", False) is True
