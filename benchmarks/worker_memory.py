"""Resident memory of a worker delivering a large backlog (not a timed test; run by hand).

Submits N jobs to a fresh SQLite outbox (one transaction), then one Worker delivers them to a
local uvicorn endpoint while a sampler records the process's resident set size (RSS, from
``/proc/self/statm``) every ``--every`` delivered jobs. A leak per job shows as RSS growing
with the jobs delivered; a flat line after warm-up means none.

    python benchmarks/worker_memory.py --jobs 100000 --concurrency 32

Prints the samples, the growth from the first sample after warm-up (10 % of the jobs) to
the last, and that growth per 1,000 jobs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from retrysafe import Outbox, RetryPolicy, SQLiteStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int
from benchmarks._wire import endpoint


def rss_mib() -> float:
    """This process's resident set size in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--jobs", type=positive_int, default=100_000)
    parser.add_argument("--concurrency", type=positive_int, default=32)
    parser.add_argument("--every", type=positive_int, default=10_000, help="jobs between samples")
    args = parser.parse_args(argv)
    n = args.jobs
    samples: list[tuple[int, float]] = []
    with endpoint() as base, tempfile.TemporaryDirectory() as tmp:
        url = f"{base}/bench"
        policy = RetryPolicy(timeout=10.0, wait_initial=0.05, wait_max=1.0)
        with SQLiteStore(Path(tmp) / "m.db") as store, Outbox(store, policy=policy) as outbox:
            start = time.perf_counter()
            with store.transaction() as conn:
                for i in range(n):
                    outbox.submit(url, json={"n": i}, connection=conn)
            submitted = time.perf_counter()
            print(f"submitted {n} jobs in {submitted - start:.1f} s; RSS {rss_mib():.1f} MiB")
            delivered = [0]

            def on_attempt(job: Any, attempt: Any, step: Any) -> None:
                delivered[0] += 1
                if delivered[0] % args.every == 0:
                    samples.append((delivered[0], rss_mib()))

            worker = outbox.worker(
                concurrency=args.concurrency, poll_interval=0.05, on_attempt=on_attempt
            )
            stats = worker.run_until_idle()
            elapsed = time.perf_counter() - submitted
    if stats.succeeded != n:
        raise SystemExit(f"delivered {stats.succeeded} of {n}")
    print(f"delivered {n} jobs in {elapsed:.1f} s ({n / elapsed:.0f} jobs/s)")
    for done, mib in samples:
        print(f"  after {done:>7} jobs: RSS {mib:7.1f} MiB")
    warm = [s for s in samples if s[0] >= n // 10]
    if len(warm) >= 2:
        growth = warm[-1][1] - warm[0][1]
        per_k = growth / ((warm[-1][0] - warm[0][0]) / 1000)
        print(
            f"growth after warm-up ({warm[0][0]} -> {warm[-1][0]} jobs): {growth:+.1f} MiB "
            f"({per_k * 1024:+.1f} KiB per 1,000 jobs)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
