"""The outbox worker's CPU per delivered job on the wire, a baseline revision beside this tree,
interleaved (not a timed test; run it by hand).

Throughput on this shared 2-core machine moves ±15 % between runs, and callgrind
(``benchmarks/instructions.py``) sees no sockets: its mock transport answers at once, so it
cannot show what depends on attempts ending one by one (how often the worker claims, wakes
and waits). This measures what the worker process itself spends: each round runs, for the
baseline and then for this tree, a fresh process that submits N jobs to a fresh SQLite file
and delivers them at concurrency C to a local uvicorn endpoint (a child process), timing
``Worker.run_until_idle`` with ``time.process_time`` (the worker process only; the endpoint
is not counted). A warm-up delivery of 500 jobs runs first in each process.

Prints the median CPU microseconds per job of each and their ratio (this tree / baseline),
with every pair, and the median jobs/s.

    python benchmarks/worker_cpu.py --baseline a8bd29c --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int
from benchmarks.instructions import ROOT, _baseline_tree, run_on

#: One process: submit, deliver, print [CPU µs per job, jobs/s] of the measured delivery.
_RUN = """
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])  # the benchmarks package (the endpoint), after PYTHONPATH
from benchmarks._wire import endpoint
from retrysafe import Outbox, RetryPolicy, SQLiteStore

n, c = int(sys.argv[1]), int(sys.argv[2])
with endpoint() as base:
    for size in (500, n):
        with tempfile.TemporaryDirectory() as tmp, SQLiteStore(Path(tmp) / "b.db") as store:
            with Outbox(store, policy=RetryPolicy(timeout=10.0)) as outbox:
                with store.transaction() as conn:
                    for i in range(size):
                        outbox.submit(base + "/bench", json={"n": i}, connection=conn)
                cpu, wall = time.process_time(), time.perf_counter()
                stats = outbox.worker(concurrency=c, poll_interval=0.05).run_until_idle()
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                if stats.succeeded != size:
                    raise SystemExit(f"delivered {stats.succeeded} of {size}")
print(json.dumps([cpu / n * 1e6, n / wall]))
"""


def _one(src: Path, jobs: int, concurrency: int) -> tuple[float, float]:
    cpu, rate = run_on(src, _RUN, str(jobs), str(concurrency), str(ROOT))
    return float(cpu), float(rate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a git revision to compare with")
    parser.add_argument("--jobs", type=positive_int, default=4000)
    parser.add_argument("--concurrency", type=positive_int, default=32)
    parser.add_argument("--rounds", type=positive_int, default=6, help="interleaved pairs")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        base = _baseline_tree(args.baseline, Path(d))
        pairs = []
        for _ in range(args.rounds):
            before = _one(base, args.jobs, args.concurrency)
            after = _one(ROOT / "src", args.jobs, args.concurrency)
            pairs.append((before, after))
            print(f"  {before[0]:7.0f} -> {after[0]:7.0f} CPU µs/job", file=sys.stderr)
    cpu_b = statistics.median(p[0][0] for p in pairs)
    cpu_a = statistics.median(p[1][0] for p in pairs)
    lower = sum(1 for p in pairs if p[1][0] < p[0][0])
    print(f"jobs={args.jobs} concurrency={args.concurrency} rounds={args.rounds} (medians)")
    print(
        f"baseline {args.baseline}: {cpu_b:7.0f} CPU µs/job, "
        f"{statistics.median(p[0][1] for p in pairs):6.0f} jobs/s"
    )
    print(
        f"this tree        : {cpu_a:7.0f} CPU µs/job, "
        f"{statistics.median(p[1][1] for p in pairs):6.0f} jobs/s"
    )
    print(f"ratio (this tree / baseline) = {cpu_a / cpu_b:.3f}; lower in {lower} of {len(pairs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
