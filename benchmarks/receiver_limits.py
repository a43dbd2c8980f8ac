"""What an oversized or stale webhook request costs the receiver (not a timed test; run it by hand).

Issue 11 measured a 300 MiB request with a 1970 timestamp: 164 s and 655 MB before its 401,
because :class:`~retrysafe.webhooks.WebhookMiddleware` read the whole body before checking
anything. This script sends that request, and a fresh-timestamp 300 MiB one (which must be cut
off at the 1 MiB limit with 413), and a normal 1 KiB delivery for reference, two ways:

(a) direct ASGI calls: ``receive()`` would hand out 300 MiB in 64 KiB chunks, each a fresh
    ``bytes`` object as a server's are (a chunk the receiver keeps counts; one it drops is
    freed at once);
(b) a real uvicorn server on loopback (in a thread of this process), the client streaming the
    body over a raw socket from one reused buffer until the answer arrives.

For each it prints the wall time until the answer, the body bytes the receiver took (a) or the
client managed to push into the socket (b), and the peak of Python memory allocated meanwhile
(``tracemalloc``, the whole process: server and client). It exits 1 when a refusal took 1 s or
more, when a stale request grew memory by 2 MiB or more (the bounds the issue asks for), or an
oversized fresh one by the 1 MiB limit plus 2 MiB (it may hold the limit, plus the
server's buffers).

    python benchmarks/receiver_limits.py            # 300 MiB
    python benchmarks/receiver_limits.py --mib 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrysafe._serving import ServerThread
from retrysafe.stores import MemoryStore
from retrysafe.webhooks import WebhookMiddleware, WebhookVerifier, signature_header

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
MIB = 1024 * 1024
CHUNK = 64 * 1024
TIME_BOUND = 1.0  # seconds, for every refusal
STALE_MEMORY_BOUND = 2 * MIB  # bytes, for a stale request (no body byte is needed)
LIMIT = MIB  # the middleware's default max_body_size
#: bytes, for a fresh oversized request: it may hold up to the limit before it is cut off
OVERSIZED_MEMORY_BOUND = LIMIT + 2 * MIB
#: A well-formed v1 signature that matches no body.
SOME_SIGNATURE = "v1,K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4="


@dataclass
class Figure:
    case: str
    way: str
    status: int
    seconds: float
    body_bytes: int
    peak: int
    memory_bound: int | None  # a refusal, held to TIME_BOUND and this; None: a reference

    def ok(self) -> bool:
        bound = self.memory_bound
        return bound is None or (self.seconds < TIME_BOUND and self.peak < bound)


async def _app(scope: Any, receive: Any, send: Any) -> None:
    while (await receive()).get("more_body", False):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def _middleware() -> WebhookMiddleware:
    return WebhookMiddleware(
        _app, verifier=WebhookVerifier(SECRET, store=MemoryStore()), path="/hook"
    )


def _headers(
    *, timestamp: int, msg_id: str, length: int | None = None, body: bytes | None = None
) -> list[tuple[bytes, bytes]]:
    sig = SOME_SIGNATURE if body is None else signature_header([SECRET], msg_id, timestamp, body)
    pairs = [
        (b"content-type", b"application/json"),
        (b"webhook-id", msg_id.encode()),
        (b"webhook-timestamp", str(timestamp).encode()),
        (b"webhook-signature", sig.encode()),
    ]
    if length is not None:
        pairs.append((b"content-length", str(length).encode()))
    return pairs


def _measure(run: Callable[[], tuple[int, int]]) -> tuple[int, int, float, int]:
    """(status, body bytes, seconds, peak bytes above the starting point) of ``run()``."""
    tracemalloc.reset_peak()
    before, _ = tracemalloc.get_traced_memory()
    started = time.perf_counter()
    status, taken = run()
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    return status, taken, seconds, peak - before


# ----------------------------------------------------------------------- (a) direct ASGI
def _direct(headers: list[tuple[bytes, bytes]], total: int, content: bytes | None) -> Any:
    middleware = _middleware()
    block = bytearray(b"x" * CHUNK)

    def run() -> tuple[int, int]:
        taken = 0
        statuses: list[int] = []

        async def receive() -> dict[str, Any]:
            nonlocal taken
            if content is not None:
                taken = len(content)
                return {"type": "http.request", "body": content, "more_body": False}
            size = min(CHUNK, total - taken)
            taken += size
            body = bytes(block[:size])  # a fresh chunk each time, as a server hands out
            return {"type": "http.request", "body": body, "more_body": taken < total}

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(int(message["status"]))

        scope = {"type": "http", "method": "POST", "path": "/hook", "headers": headers}
        asyncio.run(middleware(scope, receive, send))
        return statuses[0], taken

    return run


# ------------------------------------------------------------------------ (b) real uvicorn
def _over_socket(
    server: ServerThread,
    headers: list[tuple[bytes, bytes]],
    total: int,
    content: bytes | None,
    chunked: bool,
) -> Any:
    head = b"POST /hook HTTP/1.1\r\nhost: bench\r\n" + b"".join(
        k + b": " + v + b"\r\n" for k, v in headers
    )
    head += b"transfer-encoding: chunked\r\n\r\n" if chunked else b"\r\n"
    block = b"x" * CHUNK
    frame = (b"%x\r\n" % CHUNK + block + b"\r\n") if chunked else block

    def run() -> tuple[int, int]:
        pushed = [0]
        done = threading.Event()
        with socket.create_connection((server.host, server.port), timeout=30) as sock:
            sock.sendall(head)

            def stream() -> None:  # the body, until the answer came or the server hung up
                try:
                    if content is not None:
                        sock.sendall(content)
                        pushed[0] = len(content)
                        return
                    while pushed[0] < total and not done.is_set():
                        sock.sendall(frame)
                        pushed[0] += CHUNK
                    if chunked and not done.is_set():
                        sock.sendall(b"0\r\n\r\n")
                except OSError:
                    pass

            sender = threading.Thread(target=stream, daemon=True)
            sender.start()
            answer = b""
            while b"\r\n" not in answer:
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
            done.set()
            sock.shutdown(socket.SHUT_RDWR)  # unblocks a sendall() waiting on a full buffer
            sender.join(30)
        return int(answer.split(b" ", 2)[1]), pushed[0]

    return run


@dataclass
class Case:
    name: str
    headers: list[tuple[bytes, bytes]]
    chunked: bool = False  # over the socket: Transfer-Encoding chunked
    content: bytes | None = None  # the real body, else ``total`` bytes of "x"
    memory_bound: int | None = STALE_MEMORY_BOUND  # None: not a refusal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--mib", type=positive_int, default=300, help="size of the big requests (MiB)"
    )
    args = parser.parse_args(argv)
    total = args.mib * MIB
    now = int(time.time())
    small = json.dumps({"type": "invoice.paid", "data": "x" * 1000}).encode()
    size = f"{args.mib} MiB"
    cases = [
        Case(f"stale, Content-Length {size}", _headers(timestamp=1, length=total, msg_id="a")),
        Case(f"stale, chunked {size}", _headers(timestamp=1, msg_id="b"), chunked=True),
        Case(
            f"fresh, Content-Length {size}",
            _headers(timestamp=now, length=total, msg_id="c"),
            memory_bound=OVERSIZED_MEMORY_BOUND,
        ),
        Case(
            f"fresh, chunked {size}",
            _headers(timestamp=now, msg_id="d"),
            chunked=True,
            memory_bound=OVERSIZED_MEMORY_BOUND,
        ),
        Case(
            "valid 1 KiB delivery (reference)",
            _headers(timestamp=now, length=len(small), body=small, msg_id="e"),
            content=small,
            memory_bound=None,
        ),
    ]
    tracemalloc.start()
    figures: list[Figure] = []
    for case in cases:
        status, taken, seconds, peak = _measure(_direct(case.headers, total, case.content))
        figures.append(
            Figure(case.name, "direct ASGI", status, seconds, taken, peak, case.memory_bound)
        )
    with ServerThread(_middleware()) as server:
        for case in cases:
            run = _over_socket(server, case.headers, total, case.content, case.chunked)
            status, pushed, seconds, peak = _measure(run)
            figures.append(
                Figure(case.name, "uvicorn", status, seconds, pushed, peak, case.memory_bound)
            )
    tracemalloc.stop()

    print(
        f"{'request':34} {'way':12} {'status':>6} {'time':>10} {'body bytes':>12} "
        f"{'peak memory':>12}  bound"
    )
    for f in figures:
        verdict = "-" if f.memory_bound is None else "ok" if f.ok() else "EXCEEDED"
        print(
            f"{f.case:34} {f.way:12} {f.status:>6} {f.seconds * 1000:>7.1f} ms "
            f"{f.body_bytes:>12,} {f.peak / MIB:>8.2f} MiB  {verdict}"
        )
    print(
        f"bounds for refusals: under {TIME_BOUND:g} s; memory growth under "
        f"{STALE_MEMORY_BOUND // MIB} MiB (stale), under {OVERSIZED_MEMORY_BOUND // MIB} MiB "
        "(oversized: the limit plus 2 MiB). body bytes: taken by the middleware (direct ASGI), "
        "or pushed into the socket by the client before the answer came (uvicorn)."
    )
    return 0 if all(f.ok() for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
