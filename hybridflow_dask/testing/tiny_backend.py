"""The smallest honest Backend: every rank in the driver's process (docs/backends.md)."""

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..backends.base import InstanceRef, Slot
from ..backends.hosting import InstanceTable, PickleCopy, find_free_port


class Done(concurrent.futures.Future):
    """A call that already ran: its value, or the error it raised."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        super().__init__()
        self.set_result(value) if error is None else self.set_exception(error)


class TinyBackend:
    """Runs each call inline, copying its inputs and its result, one call at a time."""

    name = "tiny"  # what ranks see as WG_BACKEND
    in_process = True  # the kit skips its tests that kill worker processes

    def __init__(self) -> None:
        self.table = InstanceTable()  # objects; their env in os.environ; a loop each; notes
        self.refs: dict[str, InstanceRef] = {}  # what lookup() finds
        self.lock = threading.RLock()  # one call at a time, whichever thread calls
        self.copy = PickleCopy()  # copies as values travel to a process (and refuses likewise)
        self.closed = False

    def place(self, process_on_nodes: Sequence[int], use_gpu: bool | None, name: str) -> list[Slot]:
        self._open()
        if use_gpu:
            raise ValueError("TinyBackend has no GPUs: use use_gpu=False or None")
        nodes = [n for n, count in enumerate(process_on_nodes) for _ in range(count)]
        return [Slot(i, "tiny", "127.0.0.1", node=n, name=name) for i, n in enumerate(nodes)]

    def release(self, slots: Sequence[Slot]) -> None:
        pass  # nothing was reserved: every slot is this process

    def free_port(self, slot: Slot) -> int:
        self._open()
        return find_free_port("127.0.0.1")

    def alive(self, slot: Slot) -> bool:
        return not self.closed  # the driver's process cannot die under its own feet

    def replace(self, slot: Slot) -> Slot:
        self._open()
        return slot

    def create(self, ref: InstanceRef, cls: type, args: tuple, kwargs: dict, env: dict) -> Done:
        self.refs[ref.key] = ref
        init = f"{ref.group}.__init__ for rank {ref.rank}"
        return self._run(lambda a, k: self.table.create(ref, cls, a, k, env), args, kwargs, init)

    def call(self, ref: InstanceRef, method: str, args: tuple, kwargs: dict, **hints: Any) -> Done:
        where = f"{hints['label']} for rank {ref.rank}"
        return self._run(lambda a, k: self.table.invoke(ref, method, a, k), args, kwargs, where)

    def destroy(self, refs: Sequence[InstanceRef]) -> None:
        for key in [ref.key for ref in refs if self.refs.pop(ref.key, None)]:
            self.table.remove(key)  # only those still here: destroying twice is harmless

    def lookup(self, group: str) -> list[InstanceRef]:
        self._open()
        return [ref for ref in self.refs.values() if ref.group == group]

    def submit(self, fn: Callable, *args: Any, slot: Any = None, label: str = "") -> Done:
        return self._run(lambda a, k: fn(*a), args, {}, label)

    def gather(self, futures: Sequence[Any]) -> list[Any]:
        self._open()
        return [f.result() if isinstance(f, Done) else f for f in futures]

    def is_future(self, obj: Any) -> bool:
        return isinstance(obj, Done)

    def shutdown(self) -> None:
        self.destroy(list(self.refs.values()))
        self.closed = True

    def _run(self, fn: Callable[[tuple, dict], Any], args: tuple, kw: dict, where: str) -> Done:
        self._open()
        with self.lock:  # copies in, the method, the copy out: no other call in between
            try:  # a failed input fails the call, and so does one that cannot travel
                a = tuple(v.result() if isinstance(v, Done) else v for v in args)
                k = {n: v.result() if isinstance(v, Done) else v for n, v in kw.items()}
                a, k = self.copy.copy((a, k), f"the arguments of {where}")  # the caller's own
                return Done(self.copy.copy(fn(a, k), f"the result of {where}"))  # fn's own
            except Exception as exc:  # ... or the method's (annotated) error
                return Done(error=exc)

    def _open(self) -> None:
        if self.closed:
            raise RuntimeError("this TinyBackend is shut down")
