"""Fused workers: several roles in one object per rank, so they share a process and GPU.

``create_colocated_worker_cls({"actor": a, "critic": c})`` returns a ``ClassWithInitArgs``
of a class whose instance builds every role on its rank. The fused group exposes each
role's registered methods as ``<role>_<method>``; ``group.spawn(["actor", "critic"])``
gives one WorkerGroup per role with the plain method names (and reaches any other method
of the role through ``execute_all_sync``), and ``group.fuse([...])`` hangs those views on
the group as ``group.actor``. Inside the process each role finds the others with
``self.get_fused_worker_by_name("critic")`` (verl's ``fused_worker_dict``).

Methods registered with ``Dispatch.DIRECT_ROLLOUT_METHOD`` on a role whose name contains
``"rollout"`` are bound on the fused class under their plain name, where the rollout
engine inside the process looks for them (verl does the same); the driver cannot call
them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .decorators import METHOD_SPEC_ATTR, Dispatch, MethodSpec
from .worker import ClassWithInitArgs, Worker
from .worker_group import FUSED_METHOD_SEP, registered_methods

__all__ = ["FusedWorker", "create_colocated_worker_cls", "create_colocated_worker_cls_fused"]


class FusedWorker(Worker):
    """Holds one instance per role, all built with this rank's environment."""

    __hybridflow_roles__: dict[str, type] = {}
    is_fused_worker = True

    def __init__(self, roles: dict[str, tuple[type, tuple, dict]]) -> None:
        super().__init__()
        self._roles = {name: cls(*args, **kwargs) for name, (cls, args, kwargs) in roles.items()}
        self.fused_worker_dict = self._roles
        for name, instance in self._roles.items():
            # Every role sees the others (verl: Worker.fused_worker_attr_name).
            setattr(instance, Worker.fused_worker_attr_name, self._roles)
            if not hasattr(type(self), name):
                setattr(self, name, instance)

    def role(self, name: str) -> Any:
        """The instance of one role (for code running inside the fused worker)."""
        return self._roles[name]

    def _fuw_execute(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run any method of a role: ``method_name`` is ``"<role>_fwmn_<method>"``."""
        role, sep, name = method_name.partition(FUSED_METHOD_SEP)
        if not sep or role not in self._roles:
            raise ValueError(
                f"{method_name!r} names no role of this fused worker; expected "
                f"'<role>{FUSED_METHOD_SEP}<method>' with a role in {sorted(self._roles)}"
            )
        method = getattr(self._roles[role], name, None)
        if not callable(method):
            raise ValueError(
                f"role {role!r} ({type(self._roles[role]).__name__}) has no method {name!r}"
            )
        return method(*args, **kwargs)


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
            _bind_role_method(namespace, role, name, spec)
    namespace["raw_cls_dict"] = dict(namespace["__hybridflow_roles__"])
    fused = type(f"FusedWorker_{'_'.join(class_dict)}", (FusedWorker,), namespace)
    cwia = ClassWithInitArgs(fused, roles)
    cwia.fused_worker_used = True
    return cwia


def _bind_role_method(namespace: dict[str, Any], role: str, name: str, spec: MethodSpec) -> None:
    """``<role>_<name>`` on the fused class; DIRECT_ROLLOUT methods of a rollout role unprefixed."""
    if spec.dispatch_mode is Dispatch.DIRECT_ROLLOUT_METHOD and "rollout" in role:
        if name in namespace or hasattr(FusedWorker, name):
            raise ValueError(
                f"direct rollout method {name!r} of role {role!r} clashes with another "
                "method of the fused worker; rename one of them"
            )
        namespace[name] = _delegate(role, name, spec, name)
        return
    namespace[f"{role}_{name}"] = _delegate(role, name, spec, f"{role}_{name}")


def _delegate(role: str, name: str, spec: MethodSpec, bound_name: str) -> Callable[..., Any]:
    def call(self: FusedWorker, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._roles[role], name)(*args, **kwargs)

    call.__name__ = bound_name
    setattr(call, METHOD_SPEC_ATTR, spec)
    return call


#: verl's name for the fused flavour, which is the only one here.
create_colocated_worker_cls_fused = create_colocated_worker_cls
