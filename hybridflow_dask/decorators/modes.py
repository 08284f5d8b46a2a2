"""``Dispatch`` and ``Execute``: enums that users can extend at run time.

verl users add their own dispatch modes (``Dispatch.register("my_mode")`` gives
``Dispatch.MY_MODE``) and remove them again (``Dispatch.remove``), which a standard
``enum.Enum`` cannot do, so members are instances of a small class whose registry lives
on the class itself. The class also behaves like a mapping of names, as verl's
``DynamicEnum`` does: ``Dispatch["ONE_TO_ALL"]``, ``"ONE_TO_ALL" in Dispatch``,
``list(Dispatch)``, ``Dispatch.names()``, ``Dispatch.values()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, TypeVar

__all__ = ["Dispatch", "Execute", "ExtensibleEnum"]

_E = TypeVar("_E", bound="ExtensibleEnum")


class _EnumMeta(type):
    """Class-level lookups: indexing, membership and iteration over the members."""

    _members: dict[str, Any]  # set by ExtensibleEnum.__init_subclass__ on each family

    def __iter__(cls) -> Iterator[Any]:
        return iter(list(cls._members.values()))

    def __len__(cls) -> int:
        return len(cls._members)

    def __contains__(cls, item: object) -> bool:
        if isinstance(item, str):
            return item in cls._members
        return any(item is member for member in cls._members.values())

    def __getitem__(cls, name: str) -> Any:
        try:
            return cls._members[name]
        except (KeyError, TypeError):
            raise KeyError(
                f"no {cls.__name__} member {name!r}; known: {', '.join(cls._members)}"
            ) from None

    def names(cls) -> list[str]:
        """The member names, in registration order."""
        return list(cls._members)

    def values(cls) -> list[Any]:
        """The members, in registration order."""
        return list(cls._members.values())


class ExtensibleEnum(metaclass=_EnumMeta):
    """A named constant of one family; families grow with ``register``, shrink with ``remove``.

    Names are upper-cased on the way in, as verl does, so ``register("my_mode")`` and
    ``Dispatch.MY_MODE`` name the same member.
    """

    _members: ClassVar[dict[str, ExtensibleEnum]]
    _next_value: ClassVar[int]

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls._members = {}
        cls._next_value = 0

    def __init__(self, name: str, value: int) -> None:
        self.name = name
        self.value = value

    @classmethod
    def register(cls: type[_E], name: str) -> _E:
        """Add ``Cls.NAME`` (``name`` upper-cased); an existing name is a ``ValueError``."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{cls.__name__} member name must be an identifier, got {name!r}")
        key = name.upper()
        if key in cls._members:
            raise ValueError(
                f"{cls.__name__}.{key} already exists; remove it first with "
                f"{cls.__name__}.remove({key!r}) or pick another name"
            )
        member = cls(key, cls._next_value)
        cls._next_value += 1  # values are never reused, even after remove
        cls._members[key] = member
        setattr(cls, key, member)
        return member

    @classmethod
    def remove(cls, name: str) -> ExtensibleEnum:
        """Drop the member ``name`` (upper-cased) and return it; tests clean up with this."""
        key = name.upper() if isinstance(name, str) else name
        if key not in cls._members:
            raise ValueError(
                f"cannot remove {cls.__name__} {name!r}: no such member; known: "
                f"{', '.join(cls._members)}"
            )
        member = cls._members.pop(key)
        delattr(cls, key)
        return member

    @classmethod
    def members(cls) -> dict[str, ExtensibleEnum]:
        return dict(cls._members)

    @classmethod
    def from_name(cls, name: str) -> ExtensibleEnum | None:
        """The member called ``name`` (any case), or ``None`` as in verl."""
        if not isinstance(name, str):
            return None
        return cls._members.get(name.upper())

    @classmethod
    def _lookup(cls, name: str) -> ExtensibleEnum:
        member = cls.from_name(name)
        if member is None:
            raise ValueError(
                f"unknown {cls.__name__} {name!r} (was it removed, or registered only in "
                f"another process?); known: {', '.join(cls._members)}"
            )
        return member

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __reduce__(self) -> tuple:
        # Members are singletons: unpickling must give back the registered object.
        return (type(self)._lookup, (self.name,))


class Dispatch(ExtensibleEnum):
    """How a WorkerGroup call's arguments reach the ranks and how results come back."""

    RANK_ZERO: ClassVar[Dispatch]
    ONE_TO_ALL: ClassVar[Dispatch]
    ALL_TO_ALL: ClassVar[Dispatch]
    DP_COMPUTE: ClassVar[Dispatch]
    DP_COMPUTE_PROTO: ClassVar[Dispatch]
    DP_COMPUTE_PROTO_WITH_FUNC: ClassVar[Dispatch]
    DP_COMPUTE_METRIC: ClassVar[Dispatch]
    DIRECT_ROLLOUT_METHOD: ClassVar[Dispatch]


class Execute(ExtensibleEnum):
    """Which ranks run a call."""

    ALL: ClassVar[Execute]
    RANK_ZERO: ClassVar[Execute]


for _name in (
    "RANK_ZERO",
    "ONE_TO_ALL",
    "ALL_TO_ALL",
    "DP_COMPUTE",
    "DP_COMPUTE_PROTO",
    "DP_COMPUTE_PROTO_WITH_FUNC",
    "DP_COMPUTE_METRIC",
    "DIRECT_ROLLOUT_METHOD",
):
    Dispatch.register(_name)
for _name in ("ALL", "RANK_ZERO"):
    Execute.register(_name)
del _name
