"""The garbage collector in retrysafe's own processes (its command line and the demo's
service), never in an application that imports retrysafe.

An asyncio server or client keeps each request's objects (tasks, futures, frames, parsed
messages) alive for the request's whole round trip, across many of the collector's young
collections (CPython's default: one per 700 net allocations). So nearly every one of them is
promoted to the oldest generation before it dies, and the full collections that this growth
triggers come about once a second, each walking every live object (the chaos proxy's last
100,000 records, the demo's job lists). In the 40,000-job demo they took ~15 % of the wall
time, all of it under the interpreter lock (``python benchmarks/demo_scale.py``, with
``gc.callbacks`` timing each collection). With a first threshold of 50,000 the young
collections see the requests already gone, and full collections all but stop; reference
counting still frees everything acyclic at once, and cycles are still collected.
"""

from __future__ import annotations

import gc

__all__ = ["SERVING_THRESHOLD", "tune_for_serving"]

#: (young, middle, old) thresholds for a long-running process of retrysafe's.
SERVING_THRESHOLD = (50_000, 20, 10)


def tune_for_serving() -> None:
    """Set :data:`SERVING_THRESHOLD` (see the module docstring). For processes retrysafe owns:
    the ``retrysafe`` command, its child processes, the benchmarks that stand in for them."""
    gc.set_threshold(*SERVING_THRESHOLD)
