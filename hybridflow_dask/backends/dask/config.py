"""hybridflow's settings in ``dask.config`` (namespace ``hybridflow``), defaults from YAML."""

from __future__ import annotations

import gc
from pathlib import Path

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from ...protocol.large_memory import set_cache_limit

__all__ = [
    "apply_buffer_cache",
    "call_path",
    "call_timeout",
    "connect_timeout",
    "device_transfer",
    "ensure_defaults",
    "freeze_gc",
    "fresh_processes",
    "group_messages",
    "hold_threshold",
    "loop_check_interval",
    "max_local_workers",
    "message_log_length",
    "ranks_per_worker",
    "same_host_copy",
    "scatter_threshold",
    "share_colocated_inputs",
    "socket_lane",
    "task_stream_length",
    "unreachable_timeout",
    "worker_preload",
]

_DEFAULTS = Path(__file__).with_name("hybridflow.yaml")

with _DEFAULTS.open() as f:
    _LOADED = yaml.safe_load(f)
dask.config.update_defaults(_LOADED)


def ensure_defaults() -> None:
    """Put back the package's defaults where this process's config lost them: a worker
    forked from a server that imported this module (Dask's ``forkserver`` with it
    preloaded) has its config replaced by its nanny's, which lacks them when the cluster
    was made before the driver imported this module. Settings already there stay."""
    dask.config.update(dask.config.config, _LOADED, priority="old")


def call_timeout() -> float | None:
    """Seconds to wait for a call's result (``hybridflow.call-timeout``), or ``None``."""
    value = dask.config.get("hybridflow.call-timeout")
    return None if value is None else parse_timedelta(value, default="seconds")


def scheduler_timeout() -> float:
    """Seconds a lost scheduler may take to come back (``hybridflow.scheduler-timeout``)."""
    return parse_timedelta(dask.config.get("hybridflow.scheduler-timeout"), default="seconds")


def unreachable_timeout() -> float:
    """Seconds a rank's worker may be unreachable before its calls fail
    (``hybridflow.unreachable-timeout``)."""
    return parse_timedelta(dask.config.get("hybridflow.unreachable-timeout"), default="seconds")


def connect_timeout() -> float:
    """Seconds to wait for a scheduler given by address (``hybridflow.connect-timeout``)."""
    return parse_timedelta(dask.config.get("hybridflow.connect-timeout"), default="seconds")


def call_path() -> str:
    """How calls reach workers (``hybridflow.call-path``): ``"direct"`` or ``"task"``."""
    value = str(dask.config.get("hybridflow.call-path")).lower()
    if value not in ("direct", "task"):
        raise ValueError(
            f"hybridflow.call-path must be 'direct' or 'task', got {value!r}; set it with "
            "dask.config.set({'hybridflow.call-path': 'direct'})"
        )
    return value


def socket_lane() -> bool:
    """Whether blocking direct calls may use the workers' socket lanes."""
    return bool(dask.config.get("hybridflow.socket-lane"))


def group_messages() -> bool:
    """Whether a call's parts for one worker process travel as one message."""
    return bool(dask.config.get("hybridflow.group-messages"))


def same_host_copy() -> bool:
    """Whether lanes may copy large frames between the processes' memories."""
    return bool(dask.config.get("hybridflow.same-host-copy"))


def apply_buffer_cache() -> None:
    """Size this process's cache of large buffers from ``hybridflow.buffer-cache``."""
    set_cache_limit(parse_bytes(dask.config.get("hybridflow.buffer-cache")))


def freeze_gc() -> None:
    """``gc.freeze()`` what is alive now, once per process, unless ``hybridflow.freeze-gc``
    is false. Once only: a later freeze would also pin the cyclic garbage of the program's
    own objects (a dropped group, say) for good."""
    if dask.config.get("hybridflow.freeze-gc") and gc.get_freeze_count() == 0:
        gc.freeze()


def loop_check_interval() -> str | None:
    """How often an owned cluster's processes check their event loops
    (``hybridflow.loop-check-interval``, for Dask's ``distributed.admin.tick.interval``),
    or ``None`` for Dask's own."""
    raw = dask.config.get("hybridflow.loop-check-interval", None)
    if raw is None:
        return None
    try:
        seconds = parse_timedelta(raw, default="ms")
    except (TypeError, ValueError, KeyError):
        seconds = None
    if seconds is None or seconds <= 0:
        raise ValueError(
            f"hybridflow.loop-check-interval must be a positive time such as '500ms', got "
            f"{raw!r}; set it with dask.config.set({{'hybridflow.loop-check-interval': "
            "'500ms'}), or to None for Dask's own"
        )
    return f"{seconds * 1000:g}ms"


def fresh_processes() -> bool:
    """Whether a pool's workers are restarted before another pool takes them."""
    return bool(dask.config.get("hybridflow.fresh-processes"))


def worker_preload() -> list[str]:
    """The modules an owned local cluster's fork server imports for every worker process
    (``hybridflow.worker-preload``); empty: each worker starts a fresh interpreter."""
    raw = dask.config.get("hybridflow.worker-preload")
    modules = [] if raw is None else raw
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) and m for m in modules):
        raise ValueError(
            f"hybridflow.worker-preload must be a list of module names, got {raw!r}; set it "
            "with dask.config.set({'hybridflow.worker-preload': ['torch', 'transformers']}), "
            "or to [] for a fresh interpreter per worker"
        )
    return list(modules)


def share_colocated_inputs() -> bool:
    """Whether a colocated consumer gets the producer's very objects (no copy)."""
    return bool(dask.config.get("hybridflow.share-colocated-inputs"))


def max_local_workers() -> int:
    """How far an owned LocalCluster may grow (``hybridflow.max-local-workers``)."""
    return int(dask.config.get("hybridflow.max-local-workers"))


def ranks_per_worker(value: int | None = None) -> int:
    """How many ranks of one pool a worker process hosts (``value``, else
    ``hybridflow.ranks-per-worker``): 1 in real jobs; more for light ranks (tests,
    simulations of many ranks on a small machine)."""
    raw = dask.config.get("hybridflow.ranks-per-worker") if value is None else value
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
        raise ValueError(
            f"hybridflow.ranks-per-worker must be a whole number >= 1, got {raw!r}; set it "
            "with DaskBackend(ranks_per_worker=8) or "
            "dask.config.set({'hybridflow.ranks-per-worker': 8})"
        )
    return raw


def hold_threshold() -> int:
    """Bytes up to which a non-blocking call's result is held by the driver
    (``hybridflow.hold-threshold``)."""
    return parse_bytes(dask.config.get("hybridflow.hold-threshold"))


def scatter_threshold() -> int:
    """Bytes above which driver arguments are scattered (``hybridflow.scatter-threshold``)."""
    return parse_bytes(dask.config.get("hybridflow.scatter-threshold"))


#: The values of ``hybridflow.device-transfer``.
DEVICE_TRANSFER_ROUTES = ("host", "device")


def device_transfer(value: str | None = None) -> str:
    """Where CUDA tensors' bytes go when a value is copied or moved: ``"host"`` or
    ``"device"`` (``value``, else ``hybridflow.device-transfer``)."""
    raw = dask.config.get("hybridflow.device-transfer") if value is None else value
    route = str(raw).strip().lower()
    if route not in DEVICE_TRANSFER_ROUTES:
        raise ValueError(
            f"hybridflow.device-transfer must be 'host' or 'device', got {raw!r}; set it with "
            "DaskBackend(device_transfer='device') or "
            "dask.config.set({'hybridflow.device-transfer': 'device'})"
        )
    return route


def task_stream_length() -> int | None:
    """How many records a task stream the monitor starts keeps (``task-stream-length``)."""
    return _length("hybridflow.task-stream-length")


def message_log_length() -> int | None:
    """How many recent batches an owned cluster's Dask streams keep (``message-log-length``)."""
    return _length("hybridflow.message-log-length")


def _length(key: str) -> int | None:
    """A bound on one of Dask's histories; ``None`` (null) keeps Dask's own."""
    value = dask.config.get(key, None)
    return None if value is None else int(value)
