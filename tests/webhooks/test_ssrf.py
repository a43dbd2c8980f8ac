"""The SSRF guard: private destinations refused at registration and at every attempt, the
checked address pinned. No test connects anywhere but loopback: names resolve through a
patched ``socket.getaddrinfo``, and refused addresses are never dialled."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import httpx
import pytest

from retrysafe import JobState
from retrysafe.webhooks import DestinationRefusedError, Webhooks, address_problem

from .conftest import FAST, Receiver, run


def fake_dns(monkeypatch: pytest.MonkeyPatch, table: dict[str, str]) -> None:
    """Resolve the names in ``table`` to its addresses; refuse every other name."""

    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        ip = table[host]
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (ip, int(port or 0)))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize(
    ("ip", "problem"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.0.10", "private"),
        ("172.16.5.4", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::ffff:10.0.0.1", "private"),
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("2002:a00:1::", "private"),  # 6to4 of 10.0.0.1
        ("2002:a9fe:a9fe::", "link-local"),  # 6to4 of 169.254.169.254
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "private"),  # Teredo, client 192.0.2.45
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),  # Teredo, client 127.0.0.1
        ("100.64.0.1", "not globally routable"),
        ("93.184.216.34", None),
        ("2606:4700::1111", None),
    ],
)
def test_address_classes(ip: str, problem: str | None) -> None:
    """Private, loopback, link-local, multicast and reserved addresses are named; global
    unicast ones pass."""
    assert address_problem(ipaddress.ip_address(ip)) == problem


def test_private_hosts_are_refused_at_registration(
    monkeypatch: pytest.MonkeyPatch, store_url: str
) -> None:
    """A name resolving to a private address, or a loopback literal, is refused."""
    fake_dns(monkeypatch, {"internal.test": "10.0.0.5", "meta.test": "169.254.169.254"})
    with Webhooks(store_url, policy=FAST) as hooks:
        for url, reason in [
            ("http://internal.test/hook", "private"),
            ("http://meta.test/latest", "link-local"),
            ("http://127.0.0.1:9/hook", "loopback"),
            ("http://[::1]:9/hook", "loopback"),
            ("http://[2002:7f00:1::]/", "loopback"),
            ("http://nowhere.test/hook", "unresolved"),
        ]:
            with pytest.raises(DestinationRefusedError) as info:
                hooks.add_endpoint(url)
            assert info.value.reason == reason
        assert hooks.list_endpoints() == []


def test_dns_rebinding_is_refused_at_send_time(
    monkeypatch: pytest.MonkeyPatch, store_url: str
) -> None:
    """Public at registration, private at send time: the attempt is refused and never
    dialled; the delivery ends in the DLQ."""
    fake_dns(monkeypatch, {"rebind.test": "93.184.216.34"})

    def never(request: httpx.Request) -> httpx.Response:
        pytest.fail(f"dialled {request.url}")

    with Webhooks(store_url, policy=FAST) as hooks:
        hooks.add_endpoint("http://rebind.test/hook")
        fake_dns(monkeypatch, {"rebind.test": "10.9.8.7"})
        hooks.send("a.b", {})
        run(hooks, transport=httpx.MockTransport(never))
        (d,) = hooks.dead_letters()
        assert d.state is JobState.UNKNOWN
        assert {a.error_type for a in hooks.attempts(d.id)} == {"DestinationRefused"}


def test_the_checked_address_is_pinned_with_the_original_host(
    monkeypatch: pytest.MonkeyPatch, store_url: str, receiver: Receiver, base_url: str
) -> None:
    """With private destinations allowed, the request goes to the resolved address while
    keeping its Host header."""
    port = int(base_url.rsplit(":", 1)[1])
    fake_dns(monkeypatch, {"hooks.test": "127.0.0.1"})
    with Webhooks(store_url, allow_private=True, policy=FAST) as hooks:
        endpoint = hooks.add_endpoint(f"http://hooks.test:{port}/pinned")
        receiver.secrets["/pinned"] = endpoint.secrets[0][0]
        hooks.send("a.b", {})
        run(hooks)
    (seen,) = receiver.requests("/pinned")
    assert seen.headers["host"] == f"hooks.test:{port}"
    assert seen.verified


def test_sni_hostname_is_kept_for_https(monkeypatch: pytest.MonkeyPatch) -> None:
    """For https the pinned request carries the original name for TLS (sni_hostname)."""
    import asyncio

    from retrysafe.webhooks import PinnedTransport

    fake_dns(monkeypatch, {"secure.test": "93.184.216.34"})
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    transport = PinnedTransport(httpx.MockTransport(record))

    async def go() -> None:
        async with httpx.AsyncClient(transport=transport) as client:
            await client.post("https://secure.test/hook", content=b"{}")

    asyncio.run(go())
    (request,) = seen
    assert request.url.host == "93.184.216.34"
    assert request.headers["host"] == "secure.test"
    assert request.extensions["sni_hostname"] == "secure.test"


def test_the_refusal_names_both_ways_to_allow_private_destinations(store_url: str) -> None:
    """The SSRF refusal tells the library user and the CLI user how to allow it."""
    with Webhooks(store_url, policy=FAST) as hooks, pytest.raises(DestinationRefusedError) as info:
        hooks.add_endpoint("http://127.0.0.1:9/hook")
    assert "allow_private=True" in str(info.value) and "--allow-private" in str(info.value)


def test_a_worker_that_refuses_private_destinations_warns_about_such_endpoints(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Starting a worker without allow_private logs a warning naming each enabled endpoint
    on a private address; one that allows them does not."""
    with Webhooks(store_url, allow_private=True, policy=FAST) as setup:
        ep = setup.add_endpoint("http://127.0.0.1:9/hook")
        setup.add_endpoint("http://10.0.0.1:9/off", enabled=False)
    with caplog.at_level("WARNING", logger="retrysafe.webhooks"):
        with Webhooks(store_url, policy=FAST) as hooks:
            hooks.worker().close()
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and ep.id in warned[0] and "loopback" in warned[0]
        caplog.clear()
        with Webhooks(store_url, allow_private=True, policy=FAST) as hooks:
            hooks.worker().close()
        assert [r for r in caplog.records if r.levelname == "WARNING"] == []
