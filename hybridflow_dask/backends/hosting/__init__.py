"""What runs inside the process that hosts instances, the same for every backend.

- ``actor``: an instance's own thread, call order, event loop and environment;
- ``jobs``: building an instance and running one method, results captured as they return;
- ``serve``: the call flow every transport hands its calls to (``Instances``);
- ``inline``: the same jobs run in the caller's thread (in-process backends);
- ``copies``, ``environment``, ``failures``, ``ports``: the pieces they share.
"""

from __future__ import annotations

from .actor import MAX_CONCURRENCY, Actor, release_device_memory
from .copies import CopyPolicy, PickleCopy
from .environment import EnvGate, EnvSwitch
from .failures import annotate_error, explain_init_error, explain_load_error, sendable
from .inline import InstanceTable
from .jobs import Construct, Invoke
from .ports import find_free_port
from .serve import Call, CallLog, Instances, NoLog, Resolved

__all__ = [
    "MAX_CONCURRENCY",
    "Actor",
    "Call",
    "CallLog",
    "Construct",
    "CopyPolicy",
    "EnvGate",
    "EnvSwitch",
    "InstanceTable",
    "Instances",
    "Invoke",
    "NoLog",
    "PickleCopy",
    "Resolved",
    "annotate_error",
    "explain_init_error",
    "explain_load_error",
    "find_free_port",
    "release_device_memory",
    "sendable",
]
