"""The batching rule of the async hot paths (retrysafe._batch.Batcher)."""

from __future__ import annotations

import asyncio

import pytest

from retrysafe._batch import Batcher


class _Recorder:
    """A batched call that records each batch and can be held open."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: BaseException | None = None

    async def __call__(self, items: list[int]) -> list[int]:
        self.calls.append(list(items))
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return [i * 10 for i in items]


def test_items_submitted_together_go_in_one_call_and_each_gets_its_result() -> None:
    async def main() -> None:
        run = _Recorder()
        batcher = Batcher(run)
        got = await asyncio.gather(*(batcher.submit(i) for i in (1, 2, 3, 2)))
        assert got == [10, 20, 30, 20]
        assert run.calls == [[1, 2, 3, 2]]

    asyncio.run(main())


def test_items_arriving_while_a_call_runs_go_in_the_next_one_after_it() -> None:
    async def main() -> None:
        run = _Recorder()
        run.gate.clear()
        batcher = Batcher(run)
        first = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.01)
        assert run.calls == [[1]]  # sent in the iteration it was asked for
        later = [asyncio.ensure_future(batcher.submit(i)) for i in (2, 3)]
        await asyncio.sleep(0.01)
        assert run.calls == [[1]]  # waiting for the call before, never overlapping it
        run.gate.set()
        assert await first == 10 and [await f for f in later] == [20, 30]
        assert run.calls == [[1], [2, 3]]

    asyncio.run(main())


def test_a_failed_call_fails_each_of_its_submitters_and_the_next_call_runs() -> None:
    async def main() -> None:
        run = _Recorder()
        run.fail = RuntimeError("store down")
        batcher = Batcher(run)
        results = await asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True)
        assert [type(r) for r in results] == [RuntimeError, RuntimeError]
        run.fail = None
        assert await batcher.submit(4) == 40

    asyncio.run(main())


def test_a_cancelled_submitter_leaves_the_call_running_for_the_others() -> None:
    async def main() -> None:
        run = _Recorder()
        run.gate.clear()
        batcher = Batcher(run)
        a = asyncio.ensure_future(batcher.submit(1))
        b = asyncio.ensure_future(batcher.submit(2))
        await asyncio.sleep(0.01)
        a.cancel()
        run.gate.set()
        assert await b == 20
        with pytest.raises(asyncio.CancelledError):
            await a

    asyncio.run(main())


def test_a_new_event_loop_starts_afresh_after_one_stopped_mid_call() -> None:
    run = _Recorder()
    batcher = Batcher(run)

    async def stuck() -> None:
        run.gate.clear()
        waiter = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.01)
        waiter.cancel()

    asyncio.run(stuck())  # the loop ends with the call still open

    async def again() -> int:
        run.gate = asyncio.Event()
        run.gate.set()
        return await asyncio.wait_for(batcher.submit(5), 2)

    assert asyncio.run(again()) == 50
