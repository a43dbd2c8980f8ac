"""What the retry budget's deferrals cost during an outage and how soon the deferred retries go
once it ends, a baseline revision beside this tree (not a timed test; run it by hand).

A local endpoint (a uvicorn child process) answers 503 for ``--outage`` seconds, then 201. In
each round, for the baseline and then for this tree, a fresh process submits N jobs to a fresh
SQLite file and runs a worker (default :class:`~retrysafe.RetryBudget`, concurrency 32, a
policy retrying every 0.05–0.5 s) until every job succeeded. Printed per tree (medians of the
rounds): the claims, the budget's deferrals and the attempts the worker made, its process's CPU
seconds, and the seconds from the end of the outage until the last job succeeded.

    python benchmarks/budget_deferrals.py --baseline c45e029 --jobs 2000 --outage 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int
from benchmarks.instructions import ROOT, _baseline_tree, check_revision, run_on

#: The endpoint (argv: port, outage): 503 from a POST to /start for OUTAGE seconds, then 201.
_ENDPOINT = """
import sys, time, uvicorn
until = [float("inf")]
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/start":
        until[0] = time.time() + float(sys.argv[2])
        status = 204
    else:
        status = 503 if time.time() < until[0] else 201
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
            lifespan="off", loop="asyncio")
"""

#: One run (argv: jobs, outage): prints [claims, deferrals, attempts, CPU s, s after the outage].
_RUN = """
import json, socket, subprocess, sys, tempfile, time, urllib.request
from retrysafe import Outbox, RetryBudget, RetryPolicy
from retrysafe._serving import free_port

jobs, outage = int(sys.argv[1]), float(sys.argv[2])
port = free_port()
server = subprocess.Popen([sys.executable, "-c", sys.argv[3], str(port), str(outage)])
try:
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    policy = RetryPolicy(attempts=1000, wait_initial=0.05, wait_max=0.5, timeout=5.0)
    with tempfile.TemporaryDirectory() as d, Outbox(f"sqlite:///{d}/o.db", policy=policy) as ob:
        with ob.store.transaction() as conn:
            for i in range(jobs):
                ob.submit(f"http://127.0.0.1:{port}/x", json={"i": i}, connection=conn)
        worker = ob.worker(concurrency=32, budget=RetryBudget())
        urllib.request.urlopen(f"http://127.0.0.1:{port}/start", data=b"").close()
        ends = time.time() + outage
        cpu = time.process_time()
        stats = worker.run_until_idle()
        cpu = time.process_time() - cpu
        done = time.time()
    if stats.succeeded != jobs:
        raise SystemExit(f"{stats.succeeded} of {jobs} succeeded")
    print(json.dumps([stats.claimed, stats.deferred, stats.attempts, cpu, done - ends]))
finally:
    server.terminate()
    server.wait()
"""

_FIELDS = ("claims", "deferrals", "attempts", "CPU s", "s after outage")


def _one(src: Path, jobs: int, outage: float) -> list[float]:
    return [float(v) for v in run_on(src, _RUN, str(jobs), str(outage), _ENDPOINT)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a git revision to compare with")
    parser.add_argument("--jobs", type=positive_int, default=2000)
    parser.add_argument("--outage", type=positive_int, default=10, help="seconds of 503s")
    parser.add_argument("--rounds", type=positive_int, default=2, help="interleaved pairs")
    args = parser.parse_args(argv)
    check_revision(parser, args.baseline)
    runs: dict[str, list[list[float]]] = {"baseline": [], "this tree": []}
    with tempfile.TemporaryDirectory() as d:
        base = _baseline_tree(args.baseline, Path(d))
        for _ in range(args.rounds):
            for name, src in (("baseline", base), ("this tree", ROOT / "src")):
                runs[name].append(_one(src, args.jobs, args.outage))
                print(f"  {name}: {runs[name][-1]}", file=sys.stderr)
    print(f"jobs={args.jobs} outage={args.outage}s rounds={args.rounds} (medians)")
    print(f"{'':22}" + "".join(f"{f:>16}" for f in _FIELDS))
    med = {
        k: [statistics.median(r[i] for r in v) for i in range(len(_FIELDS))]
        for k, v in runs.items()
    }
    for name, label in (("baseline", f"baseline {args.baseline}"), ("this tree", "this tree")):
        print(f"{label:22}" + "".join(f"{v:16,.1f}" for v in med[name]))
    pairs = zip(med["this tree"], med["baseline"], strict=True)
    ratio = [a / b if b else float("nan") for a, b in pairs]
    print(f"{'this tree / baseline':22}" + "".join(f"{r:16.3f}" for r in ratio))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
