"""Ctrl-C while a claim is on its way: the jobs it took go back to PENDING at once."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from retrysafe import JobState, Outbox


class _LateClaims:
    """The worker's async store face, whose claims land in the store and then answer only
    once ``answer`` is set (a claim whose reply is still on the wire)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.landed = asyncio.Event()
        self.answer = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def claim_jobs(self, **kwargs: Any) -> Any:
        jobs = await self._inner.claim_jobs(**kwargs)
        if jobs:
            self.landed.set()
            await self.answer.wait()
        return jobs


@pytest.mark.anyio
async def test_jobs_claimed_when_the_worker_is_cancelled_are_released_pending(
    tmp_path: Path,
) -> None:
    """The worker is cancelled after its claim committed but before the claimed jobs came
    back: the jobs are released PENDING with their key (not left IN_FLIGHT for a lease)."""
    with Outbox(f"sqlite:///{tmp_path}/o.db") as outbox:
        jobs = [outbox.submit("http://127.0.0.1:9/x", json={"n": i}) for i in range(3)]
        worker = outbox.worker(concurrency=4, lease=60)
        late = worker._astore = _LateClaims(worker._astore)
        serving = asyncio.create_task(worker.serve())
        await asyncio.wait_for(late.landed.wait(), 10)
        assert {outbox.get(j.id).state for j in jobs} == {JobState.IN_FLIGHT}
        serving.cancel()
        await asyncio.sleep(0)  # the cancellation reaches the claim first
        late.answer.set()
        with pytest.raises(asyncio.CancelledError):
            await serving
        after = [outbox.get(j.id) for j in jobs]
    assert {j.state for j in after} == {JobState.PENDING}
    assert [j.key for j in after] == [j.key for j in jobs]
    assert all(j.sends == 0 for j in after)
    assert worker.stats.released == 3
