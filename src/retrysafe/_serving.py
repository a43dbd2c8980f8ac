"""Run an ASGI app under uvicorn on a loopback port in a background thread.

Used by the demo, the gateway's tests and the pytest plugin; applications can use it in their
own tests through :mod:`retrysafe.testing`.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from retrysafe._exceptions import ConfigurationError

__all__ = ["ServerThread", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class ServerThread:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread.

    Use as a context manager, or call :meth:`start` / :meth:`stop`. ``url`` is
    ``http://host:port`` once started.

    Args:
        app: an ASGI application.
        host: loopback address to bind (default ``127.0.0.1``).
        port: TCP port; 0 picks a free one.
        interface: ``"asgi3"`` (default) or ``"wsgi"``.
        startup_timeout: seconds to wait for the socket to listen.

    Raises:
        ConfigurationError: the server did not start (port in use, bad app).
    """

    def __init__(
        self,
        app: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        interface: str = "asgi3",
        startup_timeout: float = 10.0,
        **uvicorn_options: Any,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self._startup_timeout = startup_timeout
        options: dict[str, Any] = {
            "log_level": "warning",
            "access_log": False,
            "lifespan": "off",
            "interface": interface,
            "timeout_graceful_shutdown": 1,
        }
        options.update(uvicorn_options)
        config = uvicorn.Config(app, host=host, port=self.port, **options)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=f"uvicorn:{self.port}", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as exc:  # reported by start()
            self._error = exc

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self.server.started:
            if not self._thread.is_alive() or self._error is not None:
                raise ConfigurationError(
                    f"server on {self.host}:{self.port} did not start "
                    f"(port in use?): {self._error!r}",
                    option="listen",
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ConfigurationError(
                    f"server on {self.host}:{self.port} did not start within "
                    f"{self._startup_timeout} s",
                    option="listen",
                )
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
