"""Whether an address reaches a given listener: a proxy or gateway whose upstream is its own
listen address would forward every request to itself, without end."""

from __future__ import annotations

import contextlib
import ipaddress
import socket

__all__ = ["reaches_listener"]

_IP = ipaddress.IPv4Address | ipaddress.IPv6Address
_LOOPBACK: dict[int, _IP] = {
    4: ipaddress.IPv4Address("127.0.0.1"),
    6: ipaddress.IPv6Address("::1"),
}


def reaches_listener(host: str, port: int, *, listen_host: str, listen_port: int) -> bool:
    """Whether connecting to ``host:port`` would reach a socket listening on
    ``listen_host:listen_port`` — a proxy given its own address as upstream would forward
    every request to itself, without end.

    Names are resolved (``localhost`` reaches ``127.0.0.1``); connecting to ``0.0.0.0`` or
    ``::`` reaches the loopback address; a wildcard listener (``0.0.0.0``, ``::``, empty)
    is reached through any address of this machine. Port 0 never matches: the system picks a
    free port, so nothing listens there yet. A name that does not resolve is not a match.
    """
    if port != listen_port or port == 0:
        return False
    targets = {_LOOPBACK[a.version] if a.is_unspecified else a for a in _addresses(host)}
    if not targets:
        return False
    listening = _addresses(listen_host) if listen_host else {ipaddress.IPv4Address("0.0.0.0")}
    if any(a.is_unspecified for a in listening):
        return any(_is_local(a) for a in targets)
    return bool(targets & listening)


def _addresses(host: str) -> set[_IP]:
    """The IP addresses ``host`` (a literal or a name) stands for; empty if it resolves to none."""
    host = host.strip("[]")
    try:
        return {_plain(ipaddress.ip_address(host.partition("%")[0]))}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return set()
    found = set()
    for info in infos:
        with contextlib.suppress(ValueError):
            found.add(_plain(ipaddress.ip_address(str(info[4][0]).partition("%")[0])))
    return found


def _plain(address: _IP) -> _IP:
    """IPv4-mapped IPv6 (``::ffff:127.0.0.1``) as the IPv4 address it maps."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_local(address: _IP) -> bool:
    """Whether ``address`` belongs to this machine (it can be bound)."""
    if address.is_loopback:
        return True
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((str(address), 0))
    except OSError:
        return False
    return True
