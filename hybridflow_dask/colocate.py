"""Fused workers: several roles in one object per rank, so they share a process and GPU.

``create_colocated_worker_cls({"actor": a, "critic": c})`` returns a ``ClassWithInitArgs``
of a class whose instance builds every role on its rank. The fused group exposes each
role's registered methods as ``<role>_<method>``; ``group.spawn(["actor", "critic"])``
gives one WorkerGroup per role with the plain method names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .decorators import METHOD_SPEC_ATTR, MethodSpec
from .worker import ClassWithInitArgs, Worker
from .worker_group import registered_methods

__all__ = ["FusedWorker", "create_colocated_worker_cls"]


class FusedWorker(Worker):
    """Holds one instance per role, all built with this rank's environment."""

    __hybridflow_roles__: dict[str, type] = {}

    def __init__(self, roles: dict[str, tuple[type, tuple, dict]]) -> None:
        super().__init__()
        self._roles = {name: cls(*args, **kwargs) for name, (cls, args, kwargs) in roles.items()}

    def role(self, name: str) -> Any:
        """The instance of one role (for code running inside the fused worker)."""
        return self._roles[name]


def create_colocated_worker_cls(class_dict: dict[str, ClassWithInitArgs]) -> ClassWithInitArgs:
    """Fuse the roles of ``class_dict`` into one worker class, one instance per rank."""
    if not isinstance(class_dict, dict) or not class_dict:
        raise ValueError(
            "create_colocated_worker_cls needs a non-empty {role: ClassWithInitArgs} dict"
        )
    namespace: dict[str, Any] = {"__hybridflow_roles__": {}}
    roles: dict[str, tuple[type, tuple, dict]] = {}
    for role, cwia in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier():
            raise ValueError(f"role names must be identifiers, got {role!r}")
        if isinstance(cwia, type):
            cwia = ClassWithInitArgs(cwia)
        if not isinstance(cwia, ClassWithInitArgs):
            raise TypeError(f"class_dict[{role!r}] must be a ClassWithInitArgs, got {cwia!r}")
        namespace["__hybridflow_roles__"][role] = cwia.cls
        roles[role] = (cwia.cls, cwia.args, cwia.kwargs)
        for name, spec in registered_methods(cwia.cls).items():
            namespace[f"{role}_{name}"] = _delegate(role, name, spec)
    fused = type(f"FusedWorker_{'_'.join(class_dict)}", (FusedWorker,), namespace)
    return ClassWithInitArgs(fused, roles)


def _delegate(role: str, name: str, spec: MethodSpec) -> Callable[..., Any]:
    def call(self: FusedWorker, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._roles[role], name)(*args, **kwargs)

    call.__name__ = f"{role}_{name}"
    setattr(call, METHOD_SPEC_ATTR, spec)
    return call
