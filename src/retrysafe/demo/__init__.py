"""``retrysafe demo``: a naive client's duplicates next to retrysafe's zero (SPEC §8)."""

from retrysafe.demo._jobs import load_jobs
from retrysafe.demo._naive import run_naive
from retrysafe.demo._run import DemoOptions, DemoResult, Progress, run_demo
from retrysafe.demo._service import PublishingService

__all__ = [
    "DemoOptions",
    "DemoResult",
    "Progress",
    "PublishingService",
    "load_jobs",
    "run_demo",
    "run_naive",
]
