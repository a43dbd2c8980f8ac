"""Where the CPU goes while several ``retrysafe worker`` processes deliver on PostgreSQL, a
baseline revision beside this tree, interleaved (not a timed test; run it by hand).

Each round, for the baseline and then for this tree: a fresh database (``CREATE DATABASE``,
dropped after), N jobs submitted in one transaction, then ``--workers`` ``python -m retrysafe
worker --until-idle`` processes (the revision's ``src`` first on their path) sharing the
concurrency, to a local uvicorn endpoint. Timed from spawning them until all have exited;
CPU read per party: the workers (the benchmark's children), PostgreSQL (its postmaster's
children, live and ended: the backends), the endpoint (its process).

Prints, per round and as medians, jobs/s and the CPU microseconds per job of each party, and
the ratios this tree / baseline.

    python benchmarks/pg_cpu.py --baseline 7c0dff0~1 --jobs 10000 --workers 4 --rounds 4
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int
from benchmarks._wire import endpoint
from benchmarks.instructions import ROOT, _baseline_tree
from benchmarks.outbox_bench import _fresh_database, _split

PG = "postgresql://postgres@127.0.0.1:5432/test"

#: Submit N jobs to the database of argv[1] with the tree of this process's path.
_SUBMIT = """
import sys
from retrysafe import Outbox
from retrysafe.stores import PostgresStore
with PostgresStore(sys.argv[1]) as store, Outbox(store) as outbox:
    with store.transaction() as conn:
        for i in range(int(sys.argv[3])):
            outbox.submit(sys.argv[2], json={"n": i}, connection=conn)
"""


_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (Linux)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def _cpu(pid: int, *, ended_children: bool = False) -> float:
    """CPU seconds of ``pid`` (with ``ended_children``: of its children it waited for too)."""
    fields = _stat(pid)  # fields[11:13] utime stime, [13:15] cutime cstime, in clock ticks
    ticks = int(fields[11]) + int(fields[12])
    if ended_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICK


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat(int(entry.name))[1]) == pid:  # fields[1]: the parent's pid
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _postgres_cpu(postmaster: int) -> float:
    """CPU seconds of PostgreSQL's processes: the postmaster's ended children and live ones."""
    total = _cpu(postmaster, ended_children=True) - _cpu(postmaster)
    for child in _children(postmaster):
        try:
            total += _cpu(child)
        except OSError:  # ended meanwhile: counted with the ended ones next time
            continue
    return total


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _round(
    src: Path, url: str, jobs: int, workers: int, concurrency: int, postmaster: int, ep: int
) -> dict[str, float]:
    env = {"PYTHONPATH": str(src)}
    with _fresh_database(PG) as db:
        subprocess.run(
            [sys.executable, "-c", _SUBMIT, db, url, str(jobs)],
            env={**os.environ, **env},
            check=True,
        )
        endpoint_before = _cpu(ep)
        pg_before, workers_before = _postgres_cpu(postmaster), _children_cpu()
        start = time.perf_counter()
        worker = [sys.executable, "-m", "retrysafe", "worker", "--store", db, "--until-idle"]
        procs = [
            subprocess.Popen(
                [*worker, "-c", str(share), "--timeout", "10", "--json"],
                stdout=subprocess.DEVNULL,
                env={**os.environ, **env},
            )
            for share in _split(concurrency, workers)
        ]
        codes = [p.wait() for p in procs]
        wall = time.perf_counter() - start
        if any(codes):
            raise SystemExit(f"a worker on {src} failed: exit codes {codes}")
        per_job = 1e6 / jobs
        return {
            "jobs/s": jobs / wall,
            "workers": (_children_cpu() - workers_before) * per_job,
            "postgres": (_postgres_cpu(postmaster) - pg_before) * per_job,
            "endpoint": (_cpu(ep) - endpoint_before) * per_job,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--baseline", required=True, help="a git revision to compare with")
    parser.add_argument("--jobs", type=positive_int, default=10_000)
    parser.add_argument("--workers", type=positive_int, default=4)
    parser.add_argument("--concurrency", type=positive_int, default=128)
    parser.add_argument("--rounds", type=positive_int, default=4)
    args = parser.parse_args(argv)
    pid_file = next(Path("/var/run/postgresql").glob("*.pid"), None)
    if pid_file is None:
        parser.error("no PostgreSQL postmaster pid file in /var/run/postgresql (a local server)")
    postmaster = int(pid_file.read_text().split()[0])
    results: dict[str, list[dict[str, float]]] = {"baseline": [], "this tree": []}
    with tempfile.TemporaryDirectory() as tmp, endpoint() as base:
        trees = {"baseline": _baseline_tree(args.baseline, Path(tmp)), "this tree": ROOT / "src"}
        [ep] = _children(os.getpid())  # the endpoint's uvicorn
        for n in range(args.rounds):
            for name, src in trees.items():
                got = _round(
                    src, f"{base}/bench", args.jobs, args.workers, args.concurrency, postmaster, ep
                )
                results[name].append(got)
                cells = "  ".join(f"{k} {v:7.0f}" for k, v in got.items())
                print(f"round {n + 1} {name:<9}: {cells}", flush=True)
    print(f"jobs={args.jobs} workers={args.workers} concurrency={args.concurrency}; CPU in µs/job")
    for key in ("jobs/s", "workers", "postgres", "endpoint"):
        b = statistics.median(r[key] for r in results["baseline"])
        t = statistics.median(r[key] for r in results["this tree"])
        print(f"{key:<9} baseline {b:8.0f}  this tree {t:8.0f}  ratio {t / b:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
