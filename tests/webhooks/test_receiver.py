"""The receiving helper: verified, and each webhook-id handled exactly once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from retrysafe import (
    JobState,
    StoreUnavailableError,
    WebhookIdReusedError,
    WebhookVerificationError,
)
from retrysafe._serving import ServerThread
from retrysafe.chaos import ChaosProxy, FaultRates
from retrysafe.stores import MemoryStore, SQLiteStore
from retrysafe.webhooks import WebhookMiddleware, Webhooks, WebhookVerifier, signature_header

from .conftest import FAST, run

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def signed(msg_id: str, body: bytes, *, secret: str = SECRET) -> dict[str, str]:
    ts = int(time.time())
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": signature_header([secret], msg_id, ts, body),
    }


def test_decorator_runs_each_id_once() -> None:
    """A duplicate delivery is acknowledged without running the handler again."""
    verifier = WebhookVerifier(SECRET, store=MemoryStore())
    calls: list[Any] = []

    @verifier.handler
    def on_event(payload: Any) -> str:
        calls.append(payload)
        return "done"

    body = b'{"n": 1}'
    first = on_event(signed("msg_1", body), body)
    second = on_event(signed("msg_1", body), body)
    assert (first.duplicate, first.result) == (False, "done")
    assert second.duplicate and second.result is None
    assert calls == [{"n": 1}]


def test_a_failing_handler_runs_again_on_retry() -> None:
    """A handler that raises releases the id, so the sender's retry runs it again."""
    verifier = WebhookVerifier(SECRET, store=MemoryStore())
    calls: list[int] = []

    def flaky(payload: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("database down")

    body = b"{}"
    with pytest.raises(RuntimeError):
        verifier.receive(signed("msg_2", body), body, flaky)
    assert not verifier.receive(signed("msg_2", body), body, flaky).duplicate
    assert verifier.receive(signed("msg_2", body), body, flaky).duplicate
    assert len(calls) == 2


def test_bad_signature_never_reaches_the_handler() -> None:
    """Verification fails with WebhookVerificationError before any claim or handler."""
    verifier = WebhookVerifier(SECRET, store=MemoryStore())
    body = b"{}"
    hdrs = signed("msg_3", b'{"other": 1}')
    with pytest.raises(WebhookVerificationError):
        verifier.receive(hdrs, body, lambda p: pytest.fail("handler ran"))


@pytest.fixture
def effects_app(tmp_path: Any) -> Iterator[tuple[ServerThread, Counter[str]]]:
    """A receiver app behind WebhookMiddleware (SQLite dedupe) counting effects per id."""
    effects: Counter[str] = Counter()

    async def handle(request: Request) -> Response:
        payload = await request.json()
        effects[request.headers["webhook-id"]] += 1
        return JSONResponse({"got": payload})

    app = Starlette(routes=[Route("/hook", handle, methods=["POST"])])
    store = SQLiteStore(tmp_path / "receiver.db")
    verifier = WebhookVerifier(SECRET, store=store)
    with ServerThread(WebhookMiddleware(app, verifier=verifier, path="/hook")) as server:
        yield server, effects
    store.close()


def test_middleware_rejects_bad_signatures(
    effects_app: tuple[ServerThread, Counter[str]],
) -> None:
    """401 problem for a bad signature; 200 duplicate for a repeat; the app runs once."""
    server, effects = effects_app
    body = b'{"a": 1}'
    bad = httpx.post(server.url + "/hook", content=body, headers=signed("m", b"{}"))
    assert bad.status_code == 401 and bad.json()["detail"] == "no matching signature"
    ok = httpx.post(server.url + "/hook", content=body, headers=signed("m", body))
    dup = httpx.post(server.url + "/hook", content=body, headers=signed("m", body))
    assert ok.status_code == 200 and dup.json() == {"duplicate": True, "webhook_id": "m"}
    assert effects == Counter({"m": 1})


def test_an_endpoint_down_for_a_while_gets_every_event_exactly_once(
    effects_app: tuple[ServerThread, Counter[str]], tmp_path: Any
) -> None:
    """Answers lost after commit, then resets, then healed: every event's effect happens
    exactly once at the receiver, though some were delivered more than once."""
    server, effects = effects_app
    with (
        Webhooks(f"sqlite:///{tmp_path / 'send.db'}", allow_private=True, policy=FAST) as hooks,
        ChaosProxy(server.url, rates=FaultRates(lose_after_commit=1.0), seed=3) as proxy,
    ):
        hooks.add_endpoint(proxy.url + "/hook", secret=SECRET)
        ids = [hooks.send("a.b", {"i": i}).id for i in range(10)]
        attempts: list[int] = []

        def outage(*_: object) -> None:
            attempts.append(1)
            if len(attempts) == 10:
                proxy.set_rates(FaultRates(reset_before_forward=1.0))
            elif len(attempts) == 15:
                proxy.heal()

        run(hooks, on_attempt=outage, concurrency=10)
        assert {d.state for d in hooks.deliveries()} == {JobState.SUCCEEDED}
        assert len(attempts) > len(ids)
    assert effects == Counter(dict.fromkeys(ids, 1))


def test_the_verifier_takes_a_str_body_and_raw_asgi_header_pairs() -> None:
    """WebhookVerifier.receive accepts a str body and (bytes, bytes) header pairs, and a
    duplicate given as bytes is still recognised."""
    verifier = WebhookVerifier(SECRET, store=MemoryStore())
    body = '{"n": "é"}'
    pairs = [(k.encode(), v.encode()) for k, v in signed("msg_s", body.encode()).items()]
    first = verifier.receive(pairs, body, lambda payload: payload)
    again = verifier.receive(signed("msg_s", body.encode()), body.encode(), lambda p: p)
    assert first.result == {"n": "é"} and not first.duplicate
    assert again.duplicate


# ------------------------------------------------------------- one claim decision (SPEC §6)
def test_a_reused_id_with_another_body_is_a_conflict_not_a_duplicate() -> None:
    """The same webhook-id with another body raises WebhookIdReusedError (both fingerprints
    kept); the handler does not run again."""
    verifier = WebhookVerifier(SECRET, store=MemoryStore())
    calls: list[Any] = []
    verifier.receive(signed("msg_r", b'{"amount": 1}'), b'{"amount": 1}', calls.append)
    with pytest.raises(WebhookIdReusedError) as info:
        verifier.receive(signed("msg_r", b'{"amount": 9}'), b'{"amount": 9}', calls.append)
    assert info.value.webhook_id == "msg_r"
    assert info.value.stored_fingerprint != info.value.fingerprint
    assert calls == [{"amount": 1}]


def test_middleware_answers_422_for_a_reused_id_with_another_body(
    effects_app: tuple[ServerThread, Counter[str]],
) -> None:
    """Through the ASGI middleware the conflict is a 422 webhook-id-reused; the app ran once."""
    server, effects = effects_app
    first = httpx.post(server.url + "/hook", content=b'{"a": 1}', headers=signed("c", b'{"a": 1}'))
    other = httpx.post(server.url + "/hook", content=b'{"a": 2}', headers=signed("c", b'{"a": 2}'))
    assert first.status_code == 200
    assert other.status_code == 422
    assert other.json()["type"] == "webhook-id-reused"
    assert effects == Counter({"c": 1})


class _ThreadCheckedStore:
    """A sync KeyStore that records whether any call ran on an event loop's thread."""

    def __init__(self, inner: SQLiteStore) -> None:
        self._inner = inner
        self.on_loop: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name == "asyncio_key_store":  # a sync-only store: the verifier must use threads
            raise AttributeError(name)
        method = getattr(self._inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                asyncio.get_running_loop()
                self.on_loop.append(name)
            except RuntimeError:
                pass
            return method(*args, **kwargs)

        return call


def test_areceive_never_calls_the_sync_store_on_the_event_loop(tmp_path: Any) -> None:
    """areceive claims, renews and completes through the store's async face: no sync store
    call blocks the event loop."""
    store = SQLiteStore(tmp_path / "r.db")
    checked = _ThreadCheckedStore(store)
    verifier = WebhookVerifier(SECRET, store=checked, lease=0.3)

    async def handler(payload: Any) -> str:
        await asyncio.sleep(0.5)  # long enough for renewals
        return "ok"

    async def main() -> None:
        body = b'{"x": 1}'
        receipt = await verifier.areceive(signed("loop-1", body), body, handler)
        assert receipt.result == "ok"
        again = await verifier.areceive(signed("loop-1", body), body, handler)
        assert again.duplicate

    asyncio.run(main())
    assert checked.on_loop == []
    store.close()


def test_a_handler_longer_than_its_lease_keeps_its_claim(tmp_path: Any) -> None:
    """A delivery handled for 1.2 s under a 0.3 s lease is renewed: a redelivery meanwhile is
    told it is in progress, never run a second time."""
    store = SQLiteStore(tmp_path / "long.db")
    verifier = WebhookVerifier(SECRET, store=store, lease=0.3)
    started = threading.Event()
    calls: list[Any] = []

    def slow(payload: Any) -> None:
        calls.append(payload)
        started.set()
        time.sleep(2.0)  # the second delivery comes 0.8 s in; margin for a loaded host

    body = b'{"slow": true}'
    first = threading.Thread(target=verifier.receive, args=(signed("long", body), body, slow))
    first.start()
    assert started.wait(5)
    time.sleep(0.8)  # well past the lease
    during = verifier.receive(signed("long", body), body, slow)
    first.join(10)
    after = verifier.receive(signed("long", body), body, slow)
    assert during.in_progress and not during.duplicate
    assert after.duplicate
    assert len(calls) == 1
    store.close()


class _CompletesDown:
    """A sync KeyStore whose ``complete`` says the store is unavailable while ``down`` is set
    (a locked SQLite file, a Redis failover): claims and renewals still work."""

    def __init__(self, inner: SQLiteStore) -> None:
        self._inner = inner
        self.down = threading.Event()

    def __getattr__(self, name: str) -> Any:
        if name == "asyncio_key_store":  # the verifier runs this sync store in threads
            raise AttributeError(name)
        method = getattr(self._inner, name)
        if name != "complete":
            return method

        def complete(*args: Any, **kwargs: Any) -> Any:
            if self.down.is_set():
                raise StoreUnavailableError("the store is down (test)")
            return method(*args, **kwargs)

        return complete


def test_middleware_never_answers_2xx_for_a_delivery_it_could_not_record(
    tmp_path: Any,
) -> None:
    """A fresh user's check: with the receiver's store locked while the handler ran, the
    sender got 200 at once, the record failed seconds later, and the redelivery after the
    lease ran the handler a second time. Record before answer: the sender gets 503
    ``store-unavailable`` (a streamed 2xx is cut before its end), the record is retried in
    the background with the claim renewed (a redelivery meanwhile: 409), and once it lands
    the redelivery is a duplicate. The handler runs once per id."""
    effects: Counter[str] = Counter()

    async def handle(request: Request) -> Response:
        await request.body()
        effects[request.headers["webhook-id"]] += 1
        if request.headers["webhook-id"] in ("streamed", "sized"):

            async def chunks() -> Any:
                yield b'{"ok": '
                yield b"true}"

            # "sized": the chunk that completes the Content-Length ends the answer (the
            # empty last message comes after it): a helper got a complete 200 that way.
            sized = {"content-length": "12"} if request.headers["webhook-id"] == "sized" else {}
            return StreamingResponse(chunks(), media_type="application/json", headers=sized)
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/hook", handle, methods=["POST"])])
    store = _CompletesDown(SQLiteStore(tmp_path / "receiver.db"))
    verifier = WebhookVerifier(SECRET, store=store, lease=0.6)
    body = b'{"n": 1}'
    store.down.set()
    with ServerThread(WebhookMiddleware(app, verifier=verifier, path="/hook")) as server:
        url = server.url + "/hook"
        first = httpx.post(url, content=body, headers=signed("plain", body))
        assert first.status_code == 503, first.text
        assert first.json()["type"] == "store-unavailable"
        assert "retry-after" in first.headers
        for msg_id in ("streamed", "sized"):
            with pytest.raises(httpx.RemoteProtocolError):  # the 2xx cut before its end
                httpx.post(url, content=body, headers=signed(msg_id, body))
        time.sleep(1.0)  # past the 0.6 s lease: the claims are renewed while recording
        for msg_id in ("plain", "streamed", "sized"):
            busy = httpx.post(url, content=body, headers=signed(msg_id, body))
            assert busy.status_code == 409, busy.text
        store.down.clear()
        deadline = time.monotonic() + 10
        for msg_id in ("plain", "streamed", "sized"):
            while True:
                again = httpx.post(url, content=body, headers=signed(msg_id, body))
                if again.status_code != 409 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert again.status_code == 200, again.text
            assert again.json() == {"duplicate": True, "webhook_id": msg_id}
    assert effects == Counter({"plain": 1, "streamed": 1, "sized": 1})
    store._inner.close()
