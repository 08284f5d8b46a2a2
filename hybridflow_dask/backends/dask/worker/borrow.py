"""Kept results fetched from a worker of the same host by copying their frames out of its memory.

Through Dask's comm a kept 32 MiB result crosses between two workers of one host through
a loopback socket: the kernel copies it twice, the reader lands it in fresh memory (slow
to touch on virtual machines, see ``protocol.large_memory``), and, as the first frame
shares its buffer with the message's header, at an unaligned address, so it is copied
once more. A kept result's frames are its snapshot, owned by the worker keeping it and
never changed while kept, so that worker lends them instead (``Lender``): it answers with
where each large frame lies (small ones travel in the answer), and keeps them alive until
the borrower gives the loan back. The borrower (``Borrower``) copies each large frame
straight into a reused block of its own (``same_host.pull``): one copy, and the value it
deserializes is its own. Once per lending process it proves that the process id names that
worker, by reading a secret the lender put in its memory (``same_host.can_read``).

Anything else (another host, a process it may not read, ``hybridflow.same-host-copy``
off) answers ``None``, and the key travels through Dask as before.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import secrets
import time
from collections.abc import Mapping
from typing import Any

from distributed.comm.addressing import get_address_host
from distributed.protocol.serialize import deserialize

from ....protocol.large_memory import take
from ..config import same_host_copy
from ..wire.messages import LEAVE_MIN, pack
from ..wire.same_host import Probe, address_of, can_read, pull, supported

__all__ = ["LOAN_TIMEOUT_S", "Borrower", "Lender"]

logger = logging.getLogger(__name__)

#: A loan not given back by then (its borrower died mid-copy) is dropped.
LOAN_TIMEOUT_S = 600.0
_SECRET_BYTES = 16


class Lender:
    """Lends the frames of the values in ``data`` (a worker's memory) to borrowers on its host.

    ``lend`` and ``give_back`` are the handlers ``hf_lend`` and ``hf_give_back``; both run
    on the worker's event loop, where Dask changes ``data``.
    """

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = data
        self._secret = secrets.token_bytes(_SECRET_BYTES)
        self._probe = Probe(self._secret)
        self._loans: dict[int, tuple[float, list[Any]]] = {}
        self._ids = itertools.count()

    def lend(self, keys: list[str]) -> dict:
        """Each held key's header and frames: a large frame as ``(address, nbytes)``, kept
        alive under the answer's ``loan`` until it is given back; keys not held are left out."""
        self._expire()
        values: dict[str, tuple[dict, list[Any]]] = {}
        lent: list[Any] = []
        for key in keys:
            if key not in self._data:
                continue
            packed = pack(self._data[key], "a kept result", back=True)
            layout: list[Any] = []
            for frame in packed.frames:
                view = memoryview(frame).cast("B")
                if view.nbytes >= LEAVE_MIN:
                    layout.append((address_of(view), view.nbytes))
                    lent.append(view)
                else:
                    layout.append(bytes(view))
            values[key] = (packed.header, layout)
        loan = next(self._ids)
        if lent:
            self._loans[loan] = (time.monotonic(), lent)
        return {
            "status": "OK",
            "pid": self._probe.pid,
            "probe": self._probe.address,
            "secret": self._secret,
            "loan": loan,
            "values": pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL),
        }

    def give_back(self, loan: int) -> dict:
        """The borrower has its copies: the frames may go (or change) now."""
        self._loans.pop(loan, None)
        return {"status": "OK"}

    def on_loan(self) -> int:
        """How many loans are out (for tests and the dashboard)."""
        return len(self._loans)

    def _expire(self) -> None:
        cutoff = time.monotonic() - LOAN_TIMEOUT_S
        for loan in [k for k, (since, _) in self._loans.items() if since < cutoff]:
            logger.warning("loan %d was not given back within %.0f s", loan, LOAN_TIMEOUT_S)
            del self._loans[loan]


class Borrower:
    """Fetches kept values from ``Lender``s on this worker's host (``borrow``)."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._proven_pids: dict[str, int] = {}  # lender -> the process proven to be it
        self._refused: set[str] = set()  # lenders whose memory this process may not read
        self._returns: set[asyncio.Task] = set()
        #: Keys this worker has copied out of other workers' memories.
        self.borrowed = 0

    def may_borrow(self, holder: str) -> bool:
        """Whether ``holder`` could lend: same host, a platform that can copy, allowed."""
        return (
            supported()
            and same_host_copy()
            and get_address_host(holder) == get_address_host(self._worker.address)
            and holder not in self._refused
        )

    async def borrow(self, holder: str, keys: list[str]) -> dict[str, Any] | None:
        """The values of those ``keys`` that ``holder`` keeps, each copied out of its
        memory; ``None`` when it cannot lend here (the caller fetches through Dask)."""
        if not self.may_borrow(holder):
            return None
        reply = await self._worker.rpc(holder).hf_lend(keys=list(keys))
        loan = reply["loan"]
        try:
            pid = reply["pid"]
            if not self._proven(holder, pid, reply["probe"], reply["secret"]):
                return None
            # Filled in place: what a thread's future returns stays referenced from a
            # reference cycle (asyncio's future chaining) until the next full collection.
            values: dict[str, Any] = {}
            await asyncio.to_thread(_copy_into, values, pid, pickle.loads(reply["values"]))
            self.borrowed += len(values)
            return values
        except OSError as exc:  # the lender ended, or may not be read after all
            logger.info("could not copy kept results from %s: %s", holder, exc)
            return None
        finally:
            self._give_back(holder, loan)

    def _proven(self, holder: str, pid: int, probe: int, secret: bytes) -> bool:
        if self._proven_pids.get(holder) == pid:
            return True
        if can_read(pid, probe, secret):
            self._proven_pids[holder] = pid
            return True
        self._refused.add(holder)
        return False

    def _give_back(self, holder: str, loan: int) -> None:
        async def send() -> None:
            try:
                await self._worker.rpc(holder).hf_give_back(loan=loan)
            except Exception as exc:  # the lender is gone: so are its loans
                logger.debug("loan %d not given back to %s: %s", loan, holder, exc)

        task = asyncio.ensure_future(send())
        self._returns.add(task)
        task.add_done_callback(self._returns.discard)


def _copy_into(out: dict[str, Any], pid: int, lent: dict[str, tuple[dict, list[Any]]]) -> None:
    """Each lent value into ``out``, deserialized from its frames, the large ones copied
    out of process ``pid``."""
    for key, (header, layout) in lent.items():
        frames = [
            pull(pid, part[0], take(part[1])) if isinstance(part, tuple) else part
            for part in layout
        ]
        out[key] = deserialize(header, frames)
