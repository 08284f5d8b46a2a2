"""One long-lived stream from the driver to a worker's ``hf_stream`` handler.

The direct path multiplexes every message for one worker over it (see ``direct_path``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from distributed.comm import CommClosedError, connect

from ..internals import reset_comm

__all__ = ["Channel"]

logger = logging.getLogger(__name__)


class Channel:
    """One long-lived stream to a worker's ``hf_stream`` handler, shared by every message.

    Messages sent in one turn of the event loop go out in one write; replies come back in
    batches and are matched to their requests by id, each handed to its callback. Opening
    a connection per call would cost a connect and a handshake each; keeping one per
    worker costs neither. No task or future per message: a burst of calls costs the loop
    one callback each.
    """

    def __init__(self, address: str, connection_args: dict) -> None:
        self.address = address
        self.broken = False
        self._connection_args = connection_args
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[Any, Callable[..., None]]] = {}
        self._outbox: list[dict] = []
        self._wake = asyncio.Event()
        self._comm: Any = None
        self.runner = asyncio.ensure_future(self._run())

    def send(
        self, msg: dict, context: Any, on_reply: Callable[[Any, dict | None, Any], None]
    ) -> None:
        """Send ``msg``; then ``on_reply(context, reply, None)``, or ``(context, None,
        error)`` when the stream breaks first. Loop thread."""
        if self.broken:
            _deliver(context, on_reply, None, CommClosedError(f"stream to {self.address} closed"))
            return
        ident = next(self._ids)
        msg["id"] = ident
        self._waiting[ident] = (context, on_reply)
        self._outbox.append(msg)
        self._wake.set()

    def close(self) -> None:
        self._fail(CommClosedError(f"stream to {self.address} closed"))
        self.runner.cancel()
        if self._comm is not None:
            self._comm.abort()

    def reset(self) -> None:
        """Close dropping what is not delivered yet (``internals.reset_comm``)."""
        if self._comm is not None:
            reset_comm(self._comm)
        self.close()

    def _hand_over(self, replies: list[dict]) -> None:
        """Each reply to its message's callback. A function of its own, so that nothing
        of the last batch (its messages hold futures and sent data) stays referenced from
        the reading loop's frame while it waits for the next one."""
        for reply in replies:
            waiter = self._waiting.pop(reply.pop("id"), None)
            if waiter is not None:
                _deliver(*waiter, reply, None)

    async def _run(self) -> None:
        try:
            self._comm = await connect(self.address, **self._connection_args)
            await self._comm.write({"op": "hf_stream", "reply": False})
            reader = asyncio.ensure_future(self._read())
            try:
                while True:
                    await self._wake.wait()
                    self._wake.clear()
                    batch, self._outbox = self._outbox, []
                    await self._comm.write(batch)
                    del batch  # (its data, until the next wake-up)
            finally:
                reader.cancel()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)

    async def _read(self) -> None:
        try:
            while True:
                self._hand_over(await self._comm.read())
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(exc)
            self.runner.cancel()

    def _fail(self, exc: BaseException) -> None:
        self.broken = True
        if self._comm is not None and not self._comm.closed():
            self._comm.abort()
        if not isinstance(exc, (CommClosedError, OSError)):
            exc = CommClosedError(f"stream to {self.address} failed: {exc!r}")
        waiting, self._waiting = self._waiting, {}
        for context, on_reply in waiting.values():
            _deliver(context, on_reply, None, exc)


def _deliver(context: Any, on_reply: Callable[..., None], reply: Any, error: Any) -> None:
    try:
        on_reply(context, reply, error)
    except Exception:  # a bug in handling one reply must not cost the stream the others
        logger.exception("a reply could not be handled")
