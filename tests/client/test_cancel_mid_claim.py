"""Ctrl-C while a claim is on its way: the jobs it took go back at once (the worker's to
PENDING, a reconcile's to UNKNOWN), not IN_FLIGHT until their lease ends."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from retrysafe import JobState, Outbox, RetryPolicy
from retrysafe.client import areconcile
from retrysafe.client._sender import make_engine
from retrysafe.client._store import outbox_store
from retrysafe.observability._timed import timed_store

from .conftest import RecordsDown


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
        return await self._late(await self._inner.claim_jobs(**kwargs))

    async def claim_unknown_jobs(self, **kwargs: Any) -> Any:
        return await self._late(await self._inner.claim_unknown_jobs(**kwargs))

    async def cancel_then_answer(self, task: asyncio.Future[Any]) -> None:
        """Cancel ``task`` while its claim is on its way, then let the claim answer; the
        task ends cancelled."""
        task.cancel()
        await asyncio.sleep(0)  # the cancellation reaches the claim first
        self.answer.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def _late(self, jobs: Any) -> Any:
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
        await late.cancel_then_answer(serving)
        after = [outbox.get(j.id) for j in jobs]
    assert {j.state for j in after} == {JobState.PENDING}
    assert [j.key for j in after] == [j.key for j in jobs]
    assert all(j.sends == 0 for j in after)
    assert worker.stats.released == 3


def _unknown_jobs(outbox: Outbox, n: int) -> list[Any]:
    box = outbox_store(outbox.store)
    jobs = [outbox.submit("http://127.0.0.1:9/x", json={"n": i}) for i in range(n)]
    for job in jobs:
        box.transition_job(job.id, from_states=[JobState.PENDING], state=JobState.UNKNOWN, now=0)
    return jobs


_ONE_TRY = RetryPolicy(attempts=1, timeout=30)


@pytest.mark.anyio
async def test_a_reconcile_cancelled_while_its_claim_is_on_its_way_gives_the_jobs_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled after its claim committed but before the claimed jobs came back: the jobs
    are UNKNOWN again at once, never sent (they stayed IN_FLIGHT for a lease)."""
    lates: list[_LateClaims] = []

    def late_store(*args: Any) -> Any:
        lates.append(_LateClaims(timed_store(*args)))
        return lates[-1]

    monkeypatch.setattr("retrysafe.client._worker.timed_store", late_store)
    with Outbox(f"sqlite:///{tmp_path}/o.db") as outbox:
        jobs = _unknown_jobs(outbox, 3)
        task = asyncio.ensure_future(areconcile(outbox.store, policy=_ONE_TRY))
        for _ in range(1000):
            if lates:
                break
            await asyncio.sleep(0.01)
        await asyncio.wait_for(lates[0].landed.wait(), 10)
        assert {outbox.get(j.id).state for j in jobs} == {JobState.IN_FLIGHT}
        await lates[0].cancel_then_answer(task)
        after = [outbox.get(j.id) for j in jobs]
    assert {j.state for j in after} == {JobState.UNKNOWN}
    assert [j.key for j in after] == [j.key for j in jobs]
    assert all(j.sends == 0 for j in after)


@pytest.mark.anyio
async def test_a_reconcile_cancelled_before_its_attempts_first_ran_gives_the_jobs_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancellation lands after the claim came back, before any job's task first ran (a
    task cancelled before it starts never runs its own release): still UNKNOWN at once."""
    task: asyncio.Future[Any] | None = None

    def engine_then_cancel(*args: Any, **kwargs: Any) -> Any:
        assert task is not None
        asyncio.get_running_loop().call_soon(task.cancel)  # before the tasks' first steps
        return make_engine(*args, **kwargs)

    monkeypatch.setattr("retrysafe.client._worker.make_engine", engine_then_cancel)
    with Outbox(f"sqlite:///{tmp_path}/o.db") as outbox:
        jobs = _unknown_jobs(outbox, 4)
        task = asyncio.ensure_future(areconcile(outbox.store, policy=_ONE_TRY))
        with pytest.raises(asyncio.CancelledError):
            await task
        after = [outbox.get(j.id) for j in jobs]
    assert {j.state for j in after} == {JobState.UNKNOWN}
    assert all(j.sends == 0 for j in after)


class _NoReleases(_LateClaims):
    """:class:`_LateClaims` whose store cannot take a job back (locked, down)."""

    async def release_job(self, *args: Any, **kwargs: Any) -> Any:
        from retrysafe import StoreUnavailableError

        raise StoreUnavailableError("the store is locked")


@pytest.mark.anyio
async def test_jobs_the_store_could_not_take_back_are_counted_unreleased(
    tmp_path: Path,
) -> None:
    """A release the store refuses (locked, down) is counted ``unreleased``, not
    ``released``: the CLI's line said every in-flight job was released (a fresh user's
    check, a store locked by another process for 12 s)."""
    with Outbox(f"sqlite:///{tmp_path}/o.db") as outbox:
        jobs = [outbox.submit("http://127.0.0.1:9/x", json={"n": i}) for i in range(3)]
        worker = outbox.worker(concurrency=4, lease=60)
        late = worker._astore = _NoReleases(worker._astore)
        serving = asyncio.create_task(worker.serve())
        await asyncio.wait_for(late.landed.wait(), 10)
        await late.cancel_then_answer(serving)
        after = [outbox.get(j.id) for j in jobs]
    assert {j.state for j in after} == {JobState.IN_FLIGHT}  # they wait out their lease
    assert (worker.stats.released, worker.stats.unreleased) == (0, 3)


class _StuckReleases(_LateClaims):
    """:class:`_LateClaims` whose store never answers a release (a lock held, a network
    that swallows the reply); ``releasing`` is set once one was asked for."""

    releasing: asyncio.Event

    async def release_job(self, *args: Any, **kwargs: Any) -> Any:
        self.releasing.set()
        await asyncio.Event().wait()


@pytest.mark.anyio
async def test_releases_cut_short_by_a_second_cancel_are_counted_unreleased(
    tmp_path: Path,
) -> None:
    """A third Ctrl-C cancels the worker again while it gives its jobs back: the releases cut
    short are counted ``unreleased`` (the summary said 0 while every job stayed IN_FLIGHT)."""
    with Outbox(f"sqlite:///{tmp_path}/o.db") as outbox:
        jobs = [outbox.submit("http://127.0.0.1:9/x", json={"n": i}) for i in range(3)]
        worker = outbox.worker(concurrency=4, lease=60)
        late = worker._astore = _StuckReleases(worker._astore)
        late.releasing = asyncio.Event()
        serving = asyncio.create_task(worker.serve())
        await asyncio.wait_for(late.landed.wait(), 10)
        serving.cancel()
        await asyncio.sleep(0)
        late.answer.set()
        await asyncio.wait_for(late.releasing.wait(), 10)
        serving.cancel()  # the third Ctrl-C
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(serving, 10)
        after = [outbox.get(j.id) for j in jobs]
    assert {j.state for j in after} == {JobState.IN_FLIGHT}  # they wait out their lease
    assert (worker.stats.released, worker.stats.unreleased) == (0, 3)


@pytest.mark.anyio
async def test_attempts_whose_releases_are_cut_short_are_counted_unreleased(
    tmp_path: Path,
) -> None:
    """The same with the attempts under way (an endpoint that never answers): cancelled, each
    attempt gives its job back; cancelled again, the releases cut short are counted."""

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the worker closes the connection

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with Outbox(f"sqlite:///{tmp_path}/o.db") as outbox:
            for i in range(3):
                outbox.submit(f"http://127.0.0.1:{port}/x", json={"n": i})
            worker = outbox.worker(concurrency=4, lease=60)
            late = worker._astore = _StuckReleases(worker._astore)
            late.answer.set()
            late.releasing = asyncio.Event()
            serving = asyncio.create_task(worker.serve())
            for _ in range(1000):  # every attempt under way
                if sum(j.state is JobState.IN_FLIGHT for j in outbox.jobs()) == 3:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            serving.cancel()
            await asyncio.wait_for(late.releasing.wait(), 10)
            serving.cancel()  # the third Ctrl-C
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(serving, 10)
            after = outbox.jobs()
    finally:
        server.close()
    assert {j.state for j in after} == {JobState.IN_FLIGHT}
    assert (worker.stats.released, worker.stats.unreleased) == (0, 3)


@pytest.mark.anyio
async def test_answers_in_hand_at_a_ctrl_c_are_recorded_not_thrown_away(
    tmp_path: Path,
) -> None:
    """Ctrl-C while the outcomes of answered attempts wait for the store: each is written
    once more, alone, at the stop. They were given back PENDING as if never sent, and sent
    again by the next worker (a fresh user's check: 7 jobs answered 200 during a store
    lock, each sent twice, the first send in no record)."""

    answered: list[bool] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            answered.append(True)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with Outbox(f"sqlite:///{tmp_path}/o.db") as outbox:
            jobs = [outbox.submit(f"http://127.0.0.1:{port}/x", json={"n": i}) for i in range(3)]
            worker = outbox.worker(concurrency=4, lease=60)
            face = worker._astore = RecordsDown(worker._astore)
            serving = asyncio.create_task(worker.serve())
            for _ in range(1000):  # every request answered, each record waiting on the store
                await asyncio.sleep(0.01)
                if face.failed.is_set() and len(face.waiting) == len(answered):
                    break
            assert face.failed.is_set()
            face.down.clear()  # the store takes writes again as the Ctrl-C comes
            serving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(serving, 10)
            after = [outbox.get(j.id) for j in jobs]
            attempts = [outbox.attempts(j.id) for j in jobs]
    finally:
        server.close()
    sent = len(answered)  # the rest were held back by the destination's first limit
    assert sent >= 1 and len(face.waiting) == sent
    assert [j.state for j in after].count(JobState.SUCCEEDED) == sent
    assert sorted(len(rows) for rows in attempts) == [0] * (3 - sent) + [1] * sent
    assert all(a.status == 200 for rows in attempts for a in rows)
    assert all(j.state is JobState.PENDING and j.sends == 0 for j in after if not j.sends)
    assert worker.stats.succeeded == sent
