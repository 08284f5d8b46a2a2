"""The ``@register`` mark on worker methods."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from .modes import Dispatch, Execute

__all__ = [
    "MAGIC_ATTR",
    "METHOD_SPEC_ATTR",
    "MethodSpec",
    "get_method_spec",
    "get_predefined_execute_fn",
    "register",
]

#: The one attribute under which a registered method carries its ``MethodSpec``.
METHOD_SPEC_ATTR = "__hybridflow_method__"

#: verl's attribute name; it carries the same settings as a plain dict, for code that
#: reads ``getattr(method, MAGIC_ATTR)["dispatch_mode"]``. ``METHOD_SPEC_ATTR`` rules.
MAGIC_ATTR = "attrs_3141562937"

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class MethodSpec:
    """How a registered method is dispatched, executed and collected."""

    dispatch_mode: Any  # a Dispatch member or {"dispatch_fn": ..., "collect_fn": ...}
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool


def register(
    dispatch_mode: Any = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
) -> Callable[[F], F]:
    """Mark a worker method so that every ``WorkerGroup`` of the class exposes it.

    ``dispatch_mode`` is a ``Dispatch`` member or a dict with ``dispatch_fn`` and
    ``collect_fn``. The method itself is returned unchanged apart from the mark, so it
    still works when called directly on an instance (``def`` or ``async def``).
    """
    _check_dispatch_mode(dispatch_mode)
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute member, got {execute_mode!r}")
    spec = MethodSpec(dispatch_mode, execute_mode, bool(blocking), bool(materialize_futures))

    def mark(func: F) -> F:
        if not callable(func):
            raise TypeError(f"@register decorates methods, got {func!r}")
        setattr(func, METHOD_SPEC_ATTR, spec)
        setattr(func, MAGIC_ATTR, {f.name: getattr(spec, f.name) for f in fields(spec)})
        return func

    return mark


def get_method_spec(obj: Any) -> MethodSpec | None:
    """The ``MethodSpec`` of a registered method, or ``None``."""
    spec = getattr(obj, METHOD_SPEC_ATTR, None)
    return spec if isinstance(spec, MethodSpec) else None


def get_predefined_execute_fn(execute_mode: Execute) -> dict[str, str]:
    """The WorkerGroup method an execute mode runs through (verl's table)."""
    names = {Execute.ALL: "execute_all", Execute.RANK_ZERO: "execute_rank_zero"}
    if execute_mode not in names:
        raise ValueError(
            f"execute_mode must be Execute.ALL or Execute.RANK_ZERO, got {execute_mode!r}"
        )
    return {"execute_fn_name": names[execute_mode]}


def _check_dispatch_mode(mode: Any) -> None:
    if isinstance(mode, Dispatch):
        return
    if isinstance(mode, dict):
        missing = {"dispatch_fn", "collect_fn"} - set(mode)
        if missing:
            raise ValueError(
                f"a dict dispatch_mode needs keys {sorted(missing)}; got {sorted(mode)}"
            )
        for key in ("dispatch_fn", "collect_fn"):
            if not callable(mode[key]):
                raise TypeError(f"dispatch_mode[{key!r}] must be callable, got {mode[key]!r}")
        return
    raise TypeError(
        "dispatch_mode must be a Dispatch member or a dict with dispatch_fn/collect_fn, "
        f"got {mode!r}"
    )
