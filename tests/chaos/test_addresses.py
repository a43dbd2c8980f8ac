"""`reaches_listener`: would a connection to an upstream land on our own listening socket?"""

from __future__ import annotations

import pytest

from retrysafe._addresses import reaches_listener


@pytest.mark.parametrize(
    ("host", "port", "listen_host", "listen_port", "loops"),
    [
        ("127.0.0.1", 8899, "127.0.0.1", 8899, True),
        ("localhost", 8899, "127.0.0.1", 8899, True),
        ("127.0.0.1", 8899, "localhost", 8899, True),
        ("LOCALHOST", 8899, "127.0.0.1", 8899, True),
        ("0.0.0.0", 8899, "127.0.0.1", 8899, True),  # connecting to 0.0.0.0 reaches loopback
        ("127.0.0.1", 8899, "0.0.0.0", 8899, True),  # a wildcard listener is reached from here
        ("::ffff:127.0.0.1", 8899, "127.0.0.1", 8899, True),
        ("[::1]", 8899, "::1", 8899, True),
        ("127.0.0.1", 8898, "127.0.0.1", 8899, False),  # another port
        ("127.0.0.2", 8899, "127.0.0.1", 8899, False),  # another loopback address
        ("localhost", 0, "localhost", 0, False),  # port 0: nothing listens there yet
        ("203.0.113.7", 8899, "0.0.0.0", 8899, False),  # not an address of this machine
        ("no-such-host.invalid", 8899, "0.0.0.0", 8899, False),  # does not resolve
    ],
)
def test_reaches_listener(
    host: str, port: int, listen_host: str, listen_port: int, loops: bool
) -> None:
    """Resolved names, 0.0.0.0, wildcard listeners and IPv4-mapped addresses count as the
    same endpoint; another port, another address or an unresolvable name do not."""
    assert reaches_listener(host, port, listen_host=listen_host, listen_port=listen_port) is loops
