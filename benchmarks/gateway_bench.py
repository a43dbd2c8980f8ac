"""`retrysafe gateway` throughput against its upstream alone (not a timed test; run it by
hand).

Starts one local uvicorn upstream that does nothing (``benchmarks/_wire.py``'s endpoint, its
own process) and ``retrysafe gateway`` in front of it on a fresh SQLite file, then, in each
of ``--rounds`` interleaved rounds, sends N small JSON POSTs, each with a fresh
Idempotency-Key, at ``--concurrency`` through one aiohttp session:

(u) to the upstream directly: the limit the gateway is compared against;
(g) through this tree's gateway (every request a first-time key: claimed, forwarded,
    recorded);
(0) with ``--baseline REV``: through that revision's gateway (its own process, its ``src``
    first on the path), on a fresh SQLite file of its own.

Prints the median requests/s of each, their rounds, and the ratios (g)/(u) and (g)/(0).

    python benchmarks/gateway_bench.py --requests 3000 --concurrency 32 --rounds 3
    python benchmarks/gateway_bench.py --baseline 7fe4d3b
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int
from benchmarks._wire import endpoint, wait_listening
from benchmarks.instructions import _baseline_tree, check_revision
from retrysafe._serving import free_port


async def _post_all(url: str, n: int, concurrency: int) -> float:
    """N keyed POSTs to ``url`` at ``concurrency``; returns seconds. Any answer other than
    a 2xx ends the run (a gateway that refuses is not fast)."""
    import aiohttp

    body = b'{"n": 0}'
    left = [n]
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                headers = {
                    "content-type": "application/json",
                    "idempotency-key": uuid.uuid4().hex,
                }
                async with session.post(url, data=body, headers=headers) as answer:
                    await answer.read()
                    if not 200 <= answer.status < 300:
                        raise SystemExit(f"{url} answered {answer.status}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


@contextmanager
def _gateway(upstream: str, db: Path, src: Path | None) -> Iterator[str]:
    """``retrysafe gateway`` in front of ``upstream`` on a fresh SQLite ``db`` (``src``'s
    retrysafe when given, else this environment's); yields its base URL."""
    port = free_port()
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "retrysafe", "gateway", "--upstream", upstream,
            "--listen", f"127.0.0.1:{port}", "--store", f"sqlite:///{db}",
        ],
        env=env, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_listening(port, proc, "the gateway")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--requests", type=positive_int, default=3000)
    parser.add_argument("--concurrency", type=positive_int, default=32)
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="interleaved rounds (default 3)"
    )
    parser.add_argument("--baseline", help="a git revision whose gateway runs beside this one")
    args = parser.parse_args(argv)
    if args.baseline:
        check_revision(parser, args.baseline)
    n, c = args.requests, args.concurrency
    rates: dict[str, list[float]] = {"u": [], "g": [], "0": []}
    with endpoint(200) as upstream, tempfile.TemporaryDirectory() as tmp:
        base_src = _baseline_tree(args.baseline, Path(tmp)) if args.baseline else None
        with _gateway(upstream, Path(tmp) / "g.db", None) as ours:
            others = _gateway(upstream, Path(tmp) / "b.db", base_src) if base_src else None
            with others if others is not None else _nothing() as theirs:
                targets = {"u": upstream, "g": ours}
                if theirs:
                    targets["0"] = theirs
                for url in targets.values():  # warm-up: connections, imports, pages
                    asyncio.run(_post_all(url + "/warm", min(n, 300), c))
                for _ in range(args.rounds):
                    for k, url in targets.items():
                        rates[k].append(n / asyncio.run(_post_all(url + "/x", n, c)))

    def each(k: str) -> str:
        return ", ".join(f"{v:.0f}" for v in rates[k])

    u, g = statistics.median(rates["u"]), statistics.median(rates["g"])
    print(
        f"requests={n} concurrency={c} rounds={args.rounds} cpus={os.cpu_count()} (median; rounds)"
    )
    print(f"(u) upstream alone      : {u:7.0f} requests/s ({each('u')})")
    print(f"(g) gateway, this tree  : {g:7.0f} requests/s ({each('g')})")
    if rates["0"]:
        b = statistics.median(rates["0"])
        print(f"(0) gateway {args.baseline:<11}: {b:7.0f} requests/s ({each('0')})")
    print(f"ratio (g)/(u) = {g / u:.3f}", end="")
    if rates["0"]:
        print(f"   (g)/(0) = {g / statistics.median(rates['0']):.2f}", end="")
    print()
    return 0


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    raise SystemExit(main())
