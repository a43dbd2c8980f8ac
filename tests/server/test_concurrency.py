"""SPEC §3 concurrency, leases and retention: one handler run per key, fencing, expiry."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx

from retrysafe.core import KeyState

from .harness import HOLD, Harness, Serve, assert_problem, is_replay, records


def _fire(h: Harness, n: int, key: str) -> list[httpx.Response]:
    """``n`` identical requests released together from ``n`` threads."""
    barrier = threading.Barrier(n)

    def one(_: int) -> httpx.Response:
        barrier.wait()
        return h.post("/slow", key=key, json={"a": 1}, headers=HOLD)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_fifty_concurrent_identical_requests_run_the_handler_once(serve: Serve) -> None:
    """Of 50 simultaneous identical requests exactly one runs; the others get 409."""
    h = serve()
    timer = threading.Timer(0.3, h.effects.gate.set)
    timer.start()
    responses = _fire(h, 50, "k1")
    timer.join()
    assert h.effects.counts["slow"] == 1
    ran = [r for r in responses if r.status_code == 201 and not is_replay(r)]
    assert len(ran) == 1
    for r in responses:
        if r is not ran[0]:
            assert r.status_code == 409 or (is_replay(r) and r.content == ran[0].content)


def test_fifty_concurrent_requests_with_in_progress_wait_all_get_the_answer(
    serve: Serve,
) -> None:
    """With ``in_progress_wait`` every waiter replays the single run's response."""
    h = serve(in_progress_wait=5)
    timer = threading.Timer(0.3, h.effects.gate.set)
    timer.start()
    responses = _fire(h, 50, "k1")
    timer.join()
    assert h.effects.counts["slow"] == 1
    assert {r.status_code for r in responses} == {201}
    assert {r.content for r in responses} == {responses[0].content}
    assert sum(not is_replay(r) for r in responses) == 1


def test_repeat_while_running_is_409_with_retry_after(serve: Serve) -> None:
    """A repeat while the first attempt holds a valid lease: 409 request-in-progress."""
    h = serve()
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(h.post, "/slow", key="k1", json={}, headers=HOLD)
        assert h.effects.entered.wait(5)
        second = h.post("/slow", key="k1", json={})
        assert_problem(second, 409, "request-in-progress")
        assert 1 <= int(second.headers["retry-after"]) <= 5
        h.effects.gate.set()
        assert first.result().status_code == 201
    assert is_replay(h.post("/slow", key="k1", json={}))
    assert h.effects.counts["slow"] == 1


def test_in_progress_wait_replays_when_the_original_finishes(serve: Serve) -> None:
    """A repeat waits up to ``in_progress_wait`` seconds and then replays."""
    h = serve(in_progress_wait=5)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(h.post, "/slow", key="k1", json={}, headers=HOLD)
        assert h.effects.entered.wait(5)
        second = pool.submit(h.post, "/slow", key="k1", json={})
        threading.Timer(0.1, h.effects.gate.set).start()
        assert first.result().status_code == 201
        replayed = second.result()
    assert replayed.status_code == 201
    assert is_replay(replayed)
    assert replayed.content == first.result().content
    assert h.effects.counts["slow"] == 1


def test_in_progress_wait_gives_up_with_409(serve: Serve) -> None:
    """When the original outlasts ``in_progress_wait`` the repeat still gets 409."""
    h = serve(in_progress_wait=0.1)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(h.post, "/slow", key="k1", json={}, headers=HOLD)
        assert h.effects.entered.wait(5)
        assert_problem(h.post("/slow", key="k1", json={}), 409, "request-in-progress")
        h.effects.gate.set()
        first.result()


def test_expired_lease_is_taken_over_and_fencing_protects_the_new_owner(serve: Serve) -> None:
    """A handler whose process stalled past its lease (no renewal) is taken over; its late
    result is neither written nor shown to its client, who is told to retry (SPEC §3)."""
    h = serve(lease=30)
    with ThreadPoolExecutor(1) as pool:
        stale = pool.submit(h.post, "/slow", key="k1", json={}, headers=HOLD)
        assert h.effects.entered.wait(5)
        h.clock.advance(31)  # the first owner's lease has expired
        new_owner = h.post("/slow", key="k1", json={})
        assert new_owner.status_code == 201
        assert not is_replay(new_owner)
        h.effects.gate.set()
        late = stale.result()
    # Record before answer: the stale answer is not the key's record, so its client is sent
    # to retry, and the retry replays the new owner's answer.
    assert_problem(late, 409, "request-in-progress")
    [record] = records(h.store)
    assert record.state is KeyState.COMPLETED
    assert record.fencing_token == 2
    assert record.response is not None
    assert record.response.body == new_owner.content
    replay = h.post("/slow", key="k1", json={})
    assert is_replay(replay)
    assert replay.content == new_owner.content
    assert h.effects.counts["slow"] == 2


def test_key_past_retention_runs_again(serve: Serve) -> None:
    """A completed key whose retention ended counts as absent: the handler runs again."""
    h = serve(retention=3600, lease=60)
    h.post("/posts", key="k1", json={})
    h.clock.advance(3599)
    assert is_replay(h.post("/posts", key="k1", json={}))
    h.clock.advance(2)
    again = h.post("/posts", key="k1", json={})
    assert not is_replay(again)
    assert again.json()["n"] == 2
