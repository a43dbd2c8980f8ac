"""A TCP relay in front of the test PostgreSQL server, to take it away and bring it back."""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlsplit


class PgRelay:
    """A TCP relay to PostgreSQL on loopback that, once ``swallow`` is set, keeps accepting
    bytes and forwards nothing more (a network that loses everything, a frozen host); once
    ``lose_answers`` is set it forwards what the client sends but none of the server's
    answers (the write reaches the server and commits, its answer is lost); while ``refuse``
    is set it closes every connection, old and new (a server that is down)."""

    def __init__(self, pg_url: str) -> None:
        self.swallow = threading.Event()
        self.lose_answers = threading.Event()
        self.refuse = threading.Event()
        parts = urlsplit(pg_url)
        self._target = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, pg_url: str) -> str:
        """``pg_url`` through this relay."""
        parts = urlsplit(pg_url)
        return parts._replace(
            netloc=f"{parts.username or 'postgres'}@127.0.0.1:{self.port}"
        ).geturl()

    def down(self) -> None:
        """Refuse from now on, and cut what is open."""
        self.refuse.set()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refuse.is_set():
                client.close()
                continue
            upstream = socket.create_connection(self._target)
            self._socks += [client, upstream]
            for a, b, answers in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(a, b, answers), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while data := src.recv(65536):
                if not self.swallow.is_set() and not (answers and self.lose_answers.is_set()):
                    dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.close()
