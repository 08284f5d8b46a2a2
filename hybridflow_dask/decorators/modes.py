"""``Dispatch`` and ``Execute``: enums that users can extend at run time.

verl users add their own dispatch modes (``Dispatch.register("MY_MODE")``), which a
standard ``enum.Enum`` cannot do, so members are instances of a small class whose
registry lives on the class itself.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["Dispatch", "Execute", "ExtensibleEnum"]


class ExtensibleEnum:
    """A named constant of one family; families can grow with ``register``."""

    _members: ClassVar[dict[str, ExtensibleEnum]]

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls._members = {}

    def __init__(self, name: str, value: int) -> None:
        self.name = name
        self.value = value

    @classmethod
    def register(cls, name: str) -> ExtensibleEnum:
        """Add a member named ``name`` (``Cls.NAME`` afterwards); an existing name is an error."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{cls.__name__} member name must be an identifier, got {name!r}")
        if name in cls._members:
            raise ValueError(f"{cls.__name__}.{name} already exists")
        member = cls(name, len(cls._members))
        cls._members[name] = member
        setattr(cls, name, member)
        return member

    @classmethod
    def members(cls) -> dict[str, ExtensibleEnum]:
        return dict(cls._members)

    @classmethod
    def from_name(cls, name: str) -> ExtensibleEnum:
        try:
            return cls._members[name]
        except KeyError:
            raise ValueError(
                f"unknown {cls.__name__} {name!r}; known: {', '.join(cls._members)}"
            ) from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __reduce__(self) -> tuple:
        # Members are singletons: unpickling must give back the registered object.
        return (type(self).from_name, (self.name,))


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
