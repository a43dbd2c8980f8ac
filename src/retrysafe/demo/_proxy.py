"""The demo's chaos proxy in a child process: :class:`ProxyProcess`, the parent's side of
:mod:`retrysafe.demo._proxy_child` (why a process of its own, and the control lines, are
there)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from retrysafe._exceptions import ConfigurationError, RetrysafeError
from retrysafe._serving import _LIVE, last_line, reap, spawn_child
from retrysafe.chaos import FaultRates

__all__ = ["ProxyProcess"]

#: Seconds a control command may take before the proxy process counts as hung.
_ANSWER_TIMEOUT = 10.0


class ProxyProcess:
    """A :class:`~retrysafe.chaos.ChaosProxy` in front of ``upstream``, run by a child process;
    the part of the proxy's interface the demo uses (:attr:`url`, :meth:`set_rates`,
    :meth:`heal`, :meth:`stats`), each a control line to the child.

    Use as a context manager, or call :meth:`start` / :meth:`stop`.

    Args:
        upstream: the service's base URL.
        rates: the fault rates at the start.
        seed: the seed of the proxy's fault choices (None: from the OS).
        log: a file for the child's error output (default: discarded).
        startup_timeout: seconds to wait for the child to listen.

    Raises:
        ConfigurationError: (``start``) the child exited or did not listen in time; the
            message ends with its last output when ``log`` is given.
        RetrysafeError: (the commands) the child exited, or did not answer within 10 s.
    """

    def __init__(
        self,
        upstream: str,
        *,
        rates: FaultRates,
        seed: int | None,
        log: Path | None = None,
        startup_timeout: float = 20.0,
    ) -> None:
        self.upstream = upstream
        self.rates = rates
        self.seed = seed
        self.log = log
        self.startup_timeout = startup_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:port`` the proxy listens on. Valid once started."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProxyProcess:
        argv = [sys.executable, "-m", "retrysafe.demo._proxy_child"]
        argv += ["--upstream", self.upstream, "--rates", _rates_json(self.rates)]
        if self.seed is not None:
            argv += ["--seed", str(self.seed)]
        self.proc = spawn_child(self, argv, log=self.log, pipes=True)
        try:
            first = self._answer(self.startup_timeout, ConfigurationError)
            self.port = int(first["port"])
        except BaseException:
            self.stop()
            raise
        return self

    def set_rates(self, rates: FaultRates) -> None:
        """The rates for the requests that arrive from now on."""
        self._ask({"op": "rates", "rates": json.loads(_rates_json(rates))})

    def heal(self) -> None:
        """Every rate to 0: from now on the link is healthy."""
        self._ask({"op": "heal"})

    def stats(self) -> dict[str, Any]:
        """The proxy's counts since it started (:meth:`~retrysafe.chaos.ProxyStats.to_dict`)."""
        stats: dict[str, Any] = self._ask({"op": "stats"})["stats"]
        return stats

    def exited(self) -> int | None:
        """The child's exit status once it has exited (a negative signal number when a
        signal ended it), else None (running, or never started)."""
        return None if self.proc is None else self.proc.poll()

    def last_output(self) -> str:
        """``": <the child's last line of output>"``, or ``""``."""
        return last_line(self.log)

    def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        proc = self.proc
        if proc is None or proc.stdin is None:
            raise RetrysafeError("the demo's chaos proxy is not running")
        try:
            proc.stdin.write(json.dumps(command).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            raise self._gone(RetrysafeError) from None
        answer = self._answer(_ANSWER_TIMEOUT, RetrysafeError)
        if "error" in answer:
            raise RetrysafeError(
                f"the demo's chaos proxy refused {command['op']}: {answer['error']}"
            )
        return answer

    def _answer(self, timeout: float, error: type[RetrysafeError]) -> dict[str, Any]:
        """The child's next control line, waited for at most ``timeout`` seconds."""
        assert self.proc is not None and self.proc.stdout is not None
        out: IO[bytes] = self.proc.stdout
        deadline = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                line = out.readline()
                if not line:
                    raise self._gone(error)
                answer: dict[str, Any] = json.loads(line)
                return answer
            if time.monotonic() >= deadline:
                raise error(
                    f"the demo's chaos proxy did not answer within {timeout:g} s"
                    f"{self.last_output()}"
                )

    def _gone(self, error: type[RetrysafeError]) -> RetrysafeError:
        assert self.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(1.0)
        code = self.proc.poll()
        how = "is gone" if code is None else f"exited ({_status(code)})"
        return error(f"the demo's chaos proxy {how}{self.last_output()}")

    def stop(self, wait: float = 1.5) -> None:
        """Close the control pipe (the child stops), SIGKILL after ``wait`` seconds; returns
        once the child is gone. Idempotent."""
        proc = self.proc
        if proc is not None:
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            reap(proc, wait)
        _LIVE.discard(self)

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _rates_json(rates: FaultRates) -> str:
    return json.dumps(dataclasses.asdict(rates))


def _status(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"status {code}"
