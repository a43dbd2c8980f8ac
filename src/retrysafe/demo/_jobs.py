"""The demo's job set: the bundled ``jobs.jsonl`` or the user's own file."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from retrysafe._exceptions import ConfigurationError

__all__ = ["load_jobs"]


def load_jobs(path: str | Path | None, count: int) -> list[dict[str, Any]]:
    """Read ``count`` jobs (one JSON object per line) from ``path`` or the bundled file.

    When the file has fewer jobs than ``count`` it is cycled, each copy getting a distinct
    ``job_id`` suffix, so any size of run is possible from the bundled 1,000 jobs.

    Raises:
        ConfigurationError: the file is missing or unreadable, a line is not a JSON object
            (the message names the file and line number), the file holds no jobs, or
            ``count`` < 1.
    """
    if count < 1:
        raise ConfigurationError("--jobs must be at least 1", option="jobs")
    if path is None:
        text = resources.files("retrysafe.demo").joinpath("jobs.jsonl").read_text("utf-8")
        name = "bundled jobs.jsonl"
    else:
        try:
            text = Path(path).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(
                f"cannot read jobs file {path}: {exc}", option="jobs-file"
            ) from exc
        name = str(path)
    base: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            job = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigurationError(
                f"{name}, line {lineno}: not valid JSON ({exc.msg})", option="jobs-file"
            ) from None
        if not isinstance(job, dict):
            raise ConfigurationError(
                f"{name}, line {lineno}: expected a JSON object, got {type(job).__name__}",
                option="jobs-file",
            )
        job.setdefault("job_id", f"line-{lineno}")
        base.append(job)
    if not base:
        raise ConfigurationError(f"{name} holds no jobs", option="jobs-file")
    jobs = []
    for i in range(count):
        job = dict(base[i % len(base)])
        if i >= len(base):
            job["job_id"] = f"{job['job_id']}~{i // len(base)}"
        jobs.append(job)
    return jobs
