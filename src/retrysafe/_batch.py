"""Batches: the hot paths' requests that arrive together go to the store in one call.

One rule, for every async face that has a batched form of a per-item call (the worker's
attempt records, the webhook worker's endpoint and delivery reads): every item submitted
while the previous call runs, or in the same event-loop iteration, goes in the next call, and
each submitter gets its own result. A request therefore never waits for more than the call
before it, and one that arrives when nothing runs is sent in the same iteration (after the
other callbacks of that iteration, so that its neighbours join it). A read that joins a batch
is made after it was asked for, never before: batching keeps reads as fresh as one read per
caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

__all__ = ["Batcher"]

_T = TypeVar("_T")
_R = TypeVar("_R")


class Batcher(Generic[_T, _R]):
    """Calls ``run(items)`` with the items submitted together (see the module docstring).

    Args:
        run: the batched call: one result per item, in the items' order.
        loop: the one event loop every :meth:`submit` runs on, when the caller knows it (the
            worker's hot path: looking up the running loop is a system call on Python 3.11);
            by default it is looked up on every submit.

    An exception of ``run`` goes to every submitter of that call (each may retry alone);
    cancelling the call (its event loop shutting down) cancels its submitters. A submitter
    cancelled while it waits leaves the call running for the others. One event loop at a time
    uses an instance; a new loop starts afresh (what a stopped loop left queued is dropped:
    nobody awaits it).
    """

    __slots__ = ("_bound", "_loop", "_pending", "_run", "_task", "_writing")

    def __init__(
        self,
        run: Callable[[list[_T]], Awaitable[Sequence[_R]]],
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._run = run
        self._pending: list[tuple[_T, asyncio.Future[_R]]] = []
        self._writing = False
        self._task: asyncio.Future[None] | None = None
        self._loop = loop
        self._bound = loop is not None

    async def submit(self, item: _T) -> _R:
        """``item``'s result from the next call.

        Raises:
            Exception: what that call raised.
        """
        loop = self._loop
        if not self._bound:
            loop = asyncio.get_running_loop()
            if loop is not self._loop:
                self._loop, self._pending, self._writing = loop, [], False
        assert loop is not None
        future: asyncio.Future[_R] = loop.create_future()
        self._pending.append((item, future))
        if not self._writing:
            self._writing = True
            loop.call_soon(self._next)
        return await future

    def _next(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            self._writing = False
            return
        assert self._loop is not None
        self._task = task = self._loop.create_task(self._call(batch))
        task.add_done_callback(lambda _: self._next())

    async def _call(self, batch: list[tuple[_T, asyncio.Future[_R]]]) -> None:
        try:
            results = await self._run([item for item, _ in batch])
        except Exception as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:  # cancelled with the loop: so are its waiters
            for _, future in batch:
                future.cancel()
            raise
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)
