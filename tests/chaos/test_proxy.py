"""The chaos proxy on real sockets: each fault does what it says (SPEC §8)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import h11
import httpx
import pytest

from retrysafe import ConfigurationError
from retrysafe._serving import free_port
from retrysafe.chaos import ChaosProxy, Fault, FaultRates, Outcome

from .conftest import Upstream

# Short client timeouts keep the suite fast; a held answer waits longer than this.
CLIENT_TIMEOUT = 1.0


def post(proxy: ChaosProxy, op: str, *, timeout: float = CLIENT_TIMEOUT) -> httpx.Response:
    return httpx.post(f"{proxy.url}/effects/{op}", content=b"{}", timeout=timeout)


def wait_for_records(proxy: ChaosProxy, n: int, timeout: float = 5.0) -> list[dict[str, object]]:
    """The proxy writes a record once it is done with a request; wait for ``n`` of them."""
    deadline = time.monotonic() + timeout
    while len(proxy.records()) < n:
        assert time.monotonic() < deadline, f"only {len(proxy.records())} records"
        time.sleep(0.01)
    return proxy.records()


def test_no_fault_forwards_the_answer(upstream: Upstream) -> None:
    """Without faults the client gets the upstream's answer, status and body unchanged."""
    with ChaosProxy(upstream.url) as proxy:
        response = post(proxy, "op-1")
    assert response.status_code == 201
    assert response.json() == {"op": "op-1", "effects": 1}
    assert upstream.ledger.counts() == {"op-1": 1}


def test_lose_after_commit_closes_the_connection_after_the_upstream_finished(
    slow_upstream: Upstream,
) -> None:
    """The client sees a connection error only after the effect committed upstream."""
    with ChaosProxy(slow_upstream.url, rates=FaultRates(lose_after_commit=1.0)) as proxy:
        started = time.monotonic()
        with pytest.raises(httpx.TransportError):
            post(proxy, "op-lost")
        failed_at = time.time()
        # At the moment the client sees the error, the effect is already in the ledger.
        assert slow_upstream.ledger.count("op-lost") == 1
        assert time.monotonic() - started >= 0.2  # the upstream's work took 0.2 s
        (effect,) = slow_upstream.ledger.effects("op-lost")
        assert effect.ts <= failed_at
        (record,) = wait_for_records(proxy, 1)
    assert record["fault"] == Fault.LOSE_AFTER_COMMIT.value
    assert record["upstream_status"] == 201
    assert record["outcome"] == Outcome.CLOSED
    assert record["client_status"] is None


def test_error_after_commit_replaces_the_answer_with_503(upstream: Upstream) -> None:
    """The client gets a 503 problem although the effect committed upstream."""
    with ChaosProxy(upstream.url, rates=FaultRates(error_after_commit=1.0)) as proxy:
        response = post(proxy, "op-1")
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    assert upstream.ledger.counts() == {"op-1": 1}


def test_error_before_forward_never_reaches_the_upstream(upstream: Upstream) -> None:
    """A 503 without forwarding: the upstream never sees the request."""
    with ChaosProxy(upstream.url, rates=FaultRates(error_before_forward=1.0)) as proxy:
        responses = [post(proxy, f"op-{i}") for i in range(3)]
    assert [r.status_code for r in responses] == [503, 503, 503]
    assert upstream.hits == []
    assert upstream.ledger.total() == 0


def test_reset_before_forward_resets_and_never_reaches_the_upstream(upstream: Upstream) -> None:
    """The client's connection is reset (TCP RST) and the upstream never sees the request."""
    with ChaosProxy(upstream.url, rates=FaultRates(reset_before_forward=1.0)) as proxy:
        with pytest.raises(httpx.TransportError) as info:
            post(proxy, "op-1")
        (record,) = wait_for_records(proxy, 1)
    assert "reset" in str(info.value).lower() or isinstance(info.value, httpx.ReadError)
    assert record["outcome"] == Outcome.RESET
    assert upstream.hits == []


def test_hold_after_commit_exceeds_the_client_timeout(upstream: Upstream) -> None:
    """A held answer outlasts a short client timeout; the effect committed meanwhile."""
    rates = FaultRates(hold_after_commit=1.0, hold_seconds=10.0)
    with ChaosProxy(upstream.url, rates=rates) as proxy:
        started = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            post(proxy, "op-held", timeout=0.3)
        assert time.monotonic() - started < 5.0
        assert upstream.ledger.count("op-held") == 1
        # The proxy notices the client went away and stops holding.
        (record,) = wait_for_records(proxy, 1)
    assert record["outcome"] == Outcome.CLIENT_GONE
    assert record["upstream_status"] == 201


def test_hold_shorter_than_the_client_timeout_delivers_the_answer_late(upstream: Upstream) -> None:
    """A patient client gets the upstream's answer after hold_seconds."""
    rates = FaultRates(hold_after_commit=1.0, hold_seconds=0.3)
    with ChaosProxy(upstream.url, rates=rates) as proxy:
        started = time.monotonic()
        response = post(proxy, "op-1", timeout=5.0)
        elapsed = time.monotonic() - started
        (record,) = wait_for_records(proxy, 1)
    assert response.status_code == 201
    assert elapsed >= 0.3
    assert record["outcome"] == Outcome.HELD_ANSWERED


def test_closing_the_proxy_ends_a_pending_hold(upstream: Upstream) -> None:
    """Stopping the proxy drops held answers instead of waiting for them."""
    proxy = ChaosProxy(upstream.url, rates=FaultRates(hold_after_commit=1.0, hold_seconds=60))
    proxy.start_in_thread()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            post(proxy, "op-1", timeout=30)
        except httpx.TransportError as exc:
            errors.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 5
    while upstream.ledger.total() == 0:
        assert time.monotonic() < deadline, "the request never reached the upstream"
        time.sleep(0.01)
    started = time.monotonic()
    proxy.close()
    caller.join(timeout=10)
    assert time.monotonic() - started < 5
    assert len(errors) == 1


def test_dropping_busy_and_idle_connections_logs_nothing(
    upstream: Upstream, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Impatient clients, lost and held answers, then close with connections open: no
    asyncio error is logged and nothing reaches stderr."""
    caplog.set_level(logging.WARNING, logger="asyncio")
    rates = FaultRates(lose_after_commit=0.3, hold_after_commit=0.3, hold_seconds=30)
    proxy = ChaosProxy(upstream.url, rates=rates, seed=4)
    proxy.start_in_thread()

    def call(i: int) -> None:
        with contextlib.suppress(httpx.TransportError):
            post(proxy, f"op-{i}", timeout=0.2 if i % 2 else 30)

    callers = [threading.Thread(target=call, args=(i,)) for i in range(24)]
    with socket.create_connection(("127.0.0.1", proxy.port)) as idle:
        for caller in callers:
            caller.start()
        wait_for_records(proxy, 8)
        idle.sendall(b"POST /effects/half HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n")
        for caller in callers[1::2]:  # the impatient clients (0.2 s) give up
            caller.join(timeout=10)
        assert not any(caller.is_alive() for caller in callers[1::2])
        proxy.close()  # held answers are still pending
        for caller in callers:
            caller.join(timeout=10)
    asyncio_errors = [r for r in caplog.records if r.name == "asyncio"]
    assert asyncio_errors == []
    assert capfd.readouterr().err == ""


def test_latency_delays_the_answer(upstream: Upstream) -> None:
    """With latency at rate 1, every answer takes at least the configured latency."""
    rates = FaultRates(latency=1.0, latency_seconds=(0.2, 0.2))
    with ChaosProxy(upstream.url, rates=rates) as proxy:
        started = time.monotonic()
        response = post(proxy, "op-1")
        elapsed = time.monotonic() - started
    assert response.status_code == 201
    assert elapsed >= 0.2
    assert proxy.stats().latency_added == 1


def test_unreachable_upstream_answers_502_problem(tmp_path: Path) -> None:
    """When the upstream cannot be reached, the client gets a 502 problem and it is logged."""
    upstream = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "chaos.jsonl"
    with ChaosProxy(upstream, log_path=log) as proxy:
        assert proxy.probe_upstream(timeout=1) is not None
        response = post(proxy, "op-1")
    assert response.status_code == 502
    assert response.json()["type"] == "urn:retrysafe:problem:bad-gateway"
    (line,) = log.read_text().splitlines()
    record = json.loads(line)
    assert record["outcome"] == Outcome.BAD_GATEWAY
    assert "ConnectError" in record["upstream_error"]
    assert proxy.stats().upstream_errors == 1


def test_port_in_use_raises_and_leaves_no_thread(upstream: Upstream) -> None:
    """Binding a port already in use raises ConfigurationError; no proxy thread keeps running."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proxy = ChaosProxy(upstream.url, port=port)
        with pytest.raises(ConfigurationError, match="already in use") as info:
            proxy.start_in_thread()
    assert info.value.option == "listen"
    assert not [t for t in threading.enumerate() if t.name.startswith("chaos-proxy")]


@pytest.mark.parametrize("upstream_url", ["ftp://example.com", "not a url", "http://"])
def test_bad_upstream_url_is_rejected(upstream_url: str) -> None:
    """An upstream that is not an http(s) URL with a host raises ConfigurationError."""
    with pytest.raises(ConfigurationError) as info:
        ChaosProxy(upstream_url)
    assert info.value.option == "upstream"


def test_log_path_in_a_missing_directory_is_rejected(upstream: Upstream, tmp_path: Path) -> None:
    """A log file whose directory does not exist raises ConfigurationError(option="log")."""
    with pytest.raises(ConfigurationError, match="does not exist") as caught:
        ChaosProxy(upstream.url, log_path=tmp_path / "missing" / "chaos.jsonl")
    assert caught.value.option == "log"
    assert not (tmp_path / "missing").exists()


def test_keep_alive_serves_several_requests_on_one_connection(upstream: Upstream) -> None:
    """Two requests on one TCP connection both get answers (HTTP/1.1 keep-alive)."""
    with (
        ChaosProxy(upstream.url) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port)) as s,
    ):
        client = h11.Connection(h11.CLIENT)
        statuses = []
        for op in ("a", "b"):
            request = h11.Request(
                method="POST",
                target=f"/effects/{op}",
                headers=[("host", "proxy"), ("content-length", "0")],
            )
            s.sendall(client.send(request) + (client.send(h11.EndOfMessage()) or b""))
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(s.recv(65536))
                elif isinstance(event, h11.Response):
                    statuses.append(event.status_code)
                elif isinstance(event, h11.EndOfMessage):
                    break
            client.start_next_cycle()
    assert statuses == [201, 201]
    assert upstream.ledger.counts() == {"a": 1, "b": 1}


def test_jsonl_log_has_one_line_per_request_with_every_field(
    upstream: Upstream, tmp_path: Path
) -> None:
    """Each request writes one JSON line: ts, seq, method, path, key, fault, upstream, outcome."""
    log = tmp_path / "chaos.jsonl"
    with ChaosProxy(upstream.url, log_path=log) as proxy:
        started = time.perf_counter()
        httpx.post(f"{proxy.url}/effects/x?y=1", headers={"Idempotency-Key": "k-1"}, timeout=2)
        window = time.perf_counter() - started
        httpx.get(f"{proxy.url}/ping", timeout=2)
    first, second = (json.loads(line) for line in log.read_text().splitlines())
    assert set(first) == {
        "ts", "seq", "method", "path", "idempotency_key", "fault", "latency_s",
        "upstream_status", "upstream_s", "outcome", "client_status",
    }  # fmt: skip
    assert (first["seq"], first["method"], first["path"]) == (1, "POST", "/effects/x?y=1")
    assert first["idempotency_key"] == "k-1"
    assert (first["fault"], first["upstream_status"], first["client_status"]) == ("none", 201, 201)
    assert 0 < first["upstream_s"] <= window  # the upstream's share of the timed request
    assert (second["seq"], second["method"], second["idempotency_key"]) == (2, "GET", None)


def fault_sequence(upstream: Upstream, log: Path, seed: int) -> list[str]:
    rates = FaultRates(
        error_after_commit=0.25, error_before_forward=0.25, lose_after_commit=0.2, latency=0.2,
        latency_seconds=(0.0, 0.001),
    )  # fmt: skip
    with (
        ChaosProxy(upstream.url, rates=rates, seed=seed, log_path=log) as proxy,
        httpx.Client(timeout=CLIENT_TIMEOUT) as client,
    ):
        for i in range(40):
            with contextlib.suppress(httpx.TransportError):
                client.post(f"{proxy.url}/effects/op-{i}")
        wait_for_records(proxy, 40)
    return [json.loads(line)["fault"] for line in log.read_text().splitlines()]


def test_same_seed_gives_the_same_fault_sequence(upstream: Upstream, tmp_path: Path) -> None:
    """Two runs with one seed log the same faults in the same order; another seed differs."""
    first = fault_sequence(upstream, tmp_path / "a.jsonl", seed=42)
    again = fault_sequence(upstream, tmp_path / "b.jsonl", seed=42)
    other = fault_sequence(upstream, tmp_path / "c.jsonl", seed=43)
    assert first == again
    assert first != other
    assert len(set(first)) == 4  # none + three faults all occurred


def test_moderate_rates_over_real_requests_land_within_bounds(upstream: Upstream) -> None:
    """300 real requests at 8% per fault: each count is within 5σ, and each fault's effect holds."""
    n, p = 300, 0.08
    rates = FaultRates(
        lose_after_commit=p, hold_after_commit=p, error_after_commit=p,
        reset_before_forward=p, error_before_forward=p, hold_seconds=0.01,
        latency=0.1, latency_seconds=(0.0, 0.002),
    )  # fmt: skip
    seen: Counter[str] = Counter()
    with (
        ChaosProxy(upstream.url, rates=rates, seed=2024) as proxy,
        httpx.Client(timeout=CLIENT_TIMEOUT) as client,
    ):
        for i in range(n):
            try:
                seen[str(client.post(f"{proxy.url}/effects/op-{i}").status_code)] += 1
            except httpx.TransportError:
                seen["transport_error"] += 1
        records = wait_for_records(proxy, n)
    faults = Counter(str(r["fault"]) for r in records)
    sd = math.sqrt(n * p * (1 - p))
    for fault in Fault:
        expected = n * rates.rate(fault)
        assert abs(faults[fault.value] - expected) <= 5 * sd, (fault, faults)
    # Only forwarding faults reach the upstream; each of them commits exactly one effect.
    forwarded = sum(faults[f.value] for f in Fault if f.forwards)
    assert upstream.ledger.total() == forwarded == len(upstream.hits)
    # What the client saw matches the faults.
    assert seen["transport_error"] == faults["lose_after_commit"] + faults["reset_before_forward"]
    assert seen["503"] == faults["error_after_commit"] + faults["error_before_forward"]
    assert seen["201"] == faults["none"] + faults["hold_after_commit"]
    stats = proxy.stats()
    assert stats.requests == n
    assert {f.value: c for f, c in stats.by_fault.items()} == {
        f.value: faults[f.value] for f in Fault
    }


def test_set_rates_and_heal_apply_to_the_next_requests(upstream: Upstream) -> None:
    """Rates changed at runtime apply from the next request; heal() makes the link healthy."""
    with ChaosProxy(upstream.url, rates=FaultRates(error_before_forward=1.0)) as proxy:
        assert post(proxy, "a").status_code == 503
        proxy.set_rates(error_before_forward=0.0, error_after_commit=1.0)
        assert post(proxy, "b").status_code == 503
        proxy.heal()
        assert post(proxy, "c").status_code == 201
        assert proxy.rates == FaultRates()
    assert upstream.ledger.counts() == {"b": 1, "c": 1}


def test_invalid_runtime_rates_are_rejected_and_old_rates_stay(upstream: Upstream) -> None:
    """set_rates with a bad value raises ConfigurationError and changes nothing."""
    proxy = ChaosProxy(upstream.url, rates=FaultRates(latency=0.5))
    with pytest.raises(ConfigurationError):
        proxy.set_rates(lose_after_commit=1.5)
    assert proxy.rates == FaultRates(latency=0.5)


@pytest.mark.anyio
async def test_async_start_and_aclose_serve_in_the_callers_loop(upstream: Upstream) -> None:
    """The proxy runs in the caller's event loop with ``async with``."""
    rates = FaultRates(error_after_commit=1.0)
    async with (
        ChaosProxy(upstream.url, rates=rates) as proxy,
        httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client,
    ):
        response = await client.post(f"{proxy.url}/effects/op-1")
    assert response.status_code == 503
    assert upstream.ledger.counts() == {"op-1": 1}


def test_expect_100_continue_is_answered_without_delay(upstream: Upstream) -> None:
    """A client sending ``Expect: 100-continue`` gets ``100`` first, then the answer."""
    with (
        ChaosProxy(upstream.url) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port)) as s,
    ):
        s.settimeout(5)
        s.sendall(
            b"POST /effects/big HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        assert s.recv(65536).startswith(b"HTTP/1.1 100 ")
        s.sendall(b"hello")
        assert s.recv(65536).startswith(b"HTTP/1.1 201 ")
    assert upstream.ledger.counts() == {"big": 1}


def test_on_record_receives_every_log_record(upstream: Upstream) -> None:
    """The on_record callback gets one record per request, in order."""
    seen: list[dict[str, object]] = []
    with ChaosProxy(upstream.url, on_record=seen.append) as proxy:
        post(proxy, "a")
        post(proxy, "b")
        wait_for_records(proxy, 2)
    assert [r["seq"] for r in seen] == [1, 2]
