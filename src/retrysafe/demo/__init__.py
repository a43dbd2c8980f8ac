"""``retrysafe demo``: a naive client's duplicates next to retrysafe's zero (SPEC §8)."""

from retrysafe.demo._jobs import (
    MAX_BODY_SIZE,
    MAX_JOB_ID,
    cycle_jobs,
    job_body,
    load_jobs,
    read_jobs,
)
from retrysafe.demo._naive import run_naive
from retrysafe.demo._run import (
    MAX_JOBS,
    DemoOptions,
    DemoResult,
    DemoStoppedError,
    Progress,
    run_demo,
)
from retrysafe.demo._service import PublishingService

__all__ = [
    "MAX_BODY_SIZE",
    "MAX_JOBS",
    "MAX_JOB_ID",
    "DemoOptions",
    "DemoResult",
    "DemoStoppedError",
    "Progress",
    "PublishingService",
    "cycle_jobs",
    "job_body",
    "load_jobs",
    "read_jobs",
    "run_demo",
    "run_naive",
]
