"""The 100,000-job proof run (issue: the main job): protected pass at 2.5 % loss.

Calls :func:`retrysafe.demo.run_demo` with a large job set (the clients run in this process;
the publishing service and the chaos proxy in processes of their own, as in ``retrysafe
demo``) and prints wall time, jobs/s and the ratio of protected to naive throughput. Not a
test: it takes minutes.

    python benchmarks/demo_scale.py --jobs 100000 --concurrency 64

Exit status 0 only when the protected pass has zero duplicates and zero lost jobs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from retrysafe._gc import tune_for_serving
from retrysafe.demo import DemoOptions, Progress, run_demo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from benchmarks._args import positive_int


class _Dots(Progress):
    def __init__(self) -> None:
        self.last = 0.0

    def start(self, phase: str, total: int) -> None:
        print(f"{phase}: {total} jobs", file=sys.stderr, flush=True)

    def advance(self, phase: str, done: int) -> None:
        now = time.monotonic()
        if now - self.last > 10:
            self.last = now
            print(f"  {phase}: {done} done", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=positive_int, default=100_000)
    parser.add_argument("--loss-rate", type=float, default=0.025)
    parser.add_argument("--concurrency", type=positive_int, default=64)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-naive", action="store_true", help="skip the naive pass")
    args = parser.parse_args()
    logging.getLogger("retrysafe").setLevel(logging.WARNING)
    # What `retrysafe demo` does as a program (this script calls run_demo in-process).
    tune_for_serving()
    options = DemoOptions(
        jobs=args.jobs,
        loss_rate=args.loss_rate,
        concurrency=args.concurrency,
        seed=args.seed,
        naive=not args.no_naive,
    )
    result = run_demo(options, _Dots())
    doc = result.to_dict()
    print(json.dumps(doc, indent=2))
    protected = result.protected
    print(
        f"\nretrysafe: {args.jobs} jobs in {protected.seconds:.1f} s "
        f"({protected.jobs_per_second:.0f} jobs/s), duplicates {protected.report.duplicates}, "
        f"lost {protected.report.lost}"
    )
    if result.naive is not None:
        naive = result.naive
        print(
            f"naive:     {args.jobs} jobs in {naive.seconds:.1f} s "
            f"({naive.jobs_per_second:.0f} jobs/s), duplicates {naive.report.duplicates}"
        )
        print(
            f"protected / naive throughput: {protected.jobs_per_second / naive.jobs_per_second:.2f}"
        )
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
