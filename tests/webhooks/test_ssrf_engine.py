"""The SSRF guard on the default HTTP engine (aiohttp, SPEC §6): deliveries through
``Webhooks(...).worker()`` without a transport, to a real receiver on 127.0.0.1.

The engine's resolver checks every new connection's host with ``resolve_checked`` and
connects only to the checked address; IP literals are checked before the request. Names
resolve through a patched ``socket.getaddrinfo`` (see ``fake_dns``), so nothing here
connects anywhere but loopback. The httpx-transport face of the guard is in test_ssrf.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import pytest

from retrysafe import JobState
from retrysafe._wire import AiohttpEngine, WireError
from retrysafe.webhooks import Webhooks
from retrysafe.webhooks._ssrf import SSRFGuard

from .conftest import FAST, Receiver, run


class DNS:
    """A patched ``socket.getaddrinfo``: each name answers its list of addresses in turn
    (the last one repeats); every lookup is recorded; other names do not resolve."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answers: dict[str, list[str]] = {}
        self.lookups: list[str] = []
        self._lock = threading.Lock()
        monkeypatch.setattr(socket, "getaddrinfo", self.getaddrinfo)

    def set(self, name: str, *addresses: str) -> None:
        with self._lock:
            self.answers[name] = list(addresses)
            self.lookups.clear()

    def getaddrinfo(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        with self._lock:
            self.lookups.append(str(host))
            answers = self.answers.get(str(host))
            if not answers:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            ip = answers.pop(0) if len(answers) > 1 else answers[0]
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (ip, int(port or 0)))]


@pytest.fixture
def dns(monkeypatch: pytest.MonkeyPatch) -> DNS:
    return DNS(monkeypatch)


@pytest.fixture
def port(base_url: str) -> int:
    """The receiver's port on 127.0.0.1."""
    return int(base_url.rsplit(":", 1)[1])


def test_a_loopback_literal_is_refused_before_any_request(
    sqlite_url: str, receiver: Receiver, port: int
) -> None:
    """Without allow_private, a delivery to ``http://127.0.0.1:PORT`` (registered by a
    process that allowed it) is refused at every attempt as DestinationRefused; no request
    reaches the receiver, and the delivery ends in the DLQ."""
    with Webhooks(sqlite_url, allow_private=True, policy=FAST) as setup:
        setup.add_endpoint(f"http://127.0.0.1:{port}/literal")
    with Webhooks(sqlite_url, policy=FAST) as hooks:
        hooks.send("a.b", {"n": 1})
        run(hooks)
        (dead,) = hooks.dead_letters()
        assert dead.state is JobState.UNKNOWN
        attempts = hooks.attempts(dead.id)
        assert [a.outcome for a in attempts] == ["connect_error"] * len(attempts)
        assert {a.error_type for a in attempts} == {"DestinationRefused"}
    assert receiver.requests("/literal") == []


def test_a_name_rebound_to_loopback_at_send_time_is_refused(
    sqlite_url: str, receiver: Receiver, port: int, dns: DNS
) -> None:
    """A host name that resolved to a public address at registration and to 127.0.0.1 at
    send time (DNS rebinding) is refused by the engine's resolver: DestinationRefused, no
    request reaches the receiver."""
    dns.set("hooks.example", "93.184.216.34")
    with Webhooks(sqlite_url, policy=FAST) as hooks:
        hooks.add_endpoint(f"http://hooks.example:{port}/rebound")
        dns.set("hooks.example", "127.0.0.1")
        hooks.send("a.b", {"n": 1})
        run(hooks)
        (dead,) = hooks.dead_letters()
        assert {a.error_type for a in hooks.attempts(dead.id)} == {"DestinationRefused"}
    assert "hooks.example" in dns.lookups  # resolved at send time, by the guard
    assert receiver.requests("/rebound") == []


def test_allowed_private_delivery_keeps_its_host_and_connects_to_the_checked_address(
    sqlite_url: str,
    receiver: Receiver,
    port: int,
    dns: DNS,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With allow_private=True the delivery arrives, signed, with its original Host header
    (``hooks.example:PORT``), at the address the guard checked: the guard's lookup is the
    only one, and a second (which would answer 127.0.0.2, where nothing listens) never
    happens."""
    checked: list[tuple[str, list[str]]] = []
    resolve = SSRFGuard.resolve

    def spy(self: SSRFGuard, host: str, port: int, url: str) -> list[str]:
        addresses = resolve(self, host, port, url)
        checked.append((host, addresses))
        return addresses

    monkeypatch.setattr(SSRFGuard, "resolve", spy)
    dns.set("hooks.example", "127.0.0.1")
    with Webhooks(sqlite_url, allow_private=True, policy=FAST) as hooks:
        endpoint = hooks.add_endpoint(f"http://hooks.example:{port}/pinned")
        receiver.secrets["/pinned"] = endpoint.secrets[0][0]
        dns.set("hooks.example", "127.0.0.1", "127.0.0.2")
        hooks.send("a.b", {"n": 1})
        run(hooks)
        assert hooks.dead_letters() == []
    (seen,) = receiver.requests("/pinned")
    assert seen.headers["host"] == f"hooks.example:{port}"
    assert seen.verified
    assert checked == [("hooks.example", ["127.0.0.1"])]
    assert dns.lookups == ["hooks.example"]


@pytest.mark.parametrize("url", ["http://[::1/hook", "http://:80/hook"])
def test_a_malformed_url_under_the_guard_is_unsupported_not_sent(url: str) -> None:
    """With the guard, a URL the engine cannot parse is an UnsupportedProtocol WireError,
    marked not sent (as without the guard), not a raw ValueError."""

    async def go() -> WireError:
        engine = AiohttpEngine(
            connect_timeout=0.5, read_timeout=0.5, guard=SSRFGuard(allow_private=True)
        )
        try:
            with pytest.raises(WireError) as info:
                await engine.send("POST", url, headers=[], body=b"{}", keep=100)
            return info.value
        finally:
            await engine.aclose()

    error = asyncio.run(go())
    assert (error.kind, error.sent, error.expected) == ("UnsupportedProtocol", False, True)
