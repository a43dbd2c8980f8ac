"""The demo's job set: the bundled ``jobs.jsonl`` or the user's own file.

A jobs file is JSON Lines: one JSON object per line, blank lines skipped. Any object is a job.
Its optional ``job_id`` names the operation (default ``line-N``); everything in it is sent as
the body of ``POST /posts``, with an ``operation`` field (``naive:<job_id>`` or
``retrysafe:<job_id>``) added so the effect ledger can count posts per operation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from retrysafe._exceptions import ConfigurationError
from retrysafe.server import IdempotencyConfig

__all__ = ["MAX_BODY_SIZE", "cycle_jobs", "job_body", "load_jobs", "read_jobs"]

#: The largest request body, in bytes, the demo's idempotency middleware accepts (its default);
#: a larger keyed request gets ``413`` and is never published.
MAX_BODY_SIZE = IdempotencyConfig().max_body_size

# The longest operation tag job_body() adds, for the size check.
_LONGEST_TAG = "retrysafe"


def job_body(job: dict[str, Any], tag: str) -> dict[str, Any]:
    """The body sent for ``job`` in the pass ``tag``: the job plus ``operation = tag:job_id``."""
    return {**job, "operation": f"{tag}:{job['job_id']}"}


def _encoded_size(body: dict[str, Any]) -> int:
    # As the outbox encodes a JSON body (compact, ASCII-escaped): never smaller than httpx's.
    return len(json.dumps(body, separators=(",", ":")).encode())


def read_jobs(
    path: str | Path | None, *, max_body_size: int = MAX_BODY_SIZE, copies: int = 1
) -> list[dict[str, Any]]:
    """Read and check every job of ``path`` (or of the bundled file when None), in order.

    Args:
        path: a JSONL file, one JSON object per line; None for the bundled 1,000 jobs.
        max_body_size: the service's body limit in bytes; every job, sent as a body (see
            :func:`job_body`), must fit.
        copies: how many times the jobs will be cycled (the copy suffix of ``job_id`` counts
            towards the body size).

    Returns:
        The jobs, each with a ``job_id`` (``line-N`` when the line has none).

    Raises:
        ConfigurationError (``option="jobs-file"``): the file is missing, unreadable or not
            UTF-8 (the message gives the byte offset); a line is not a JSON object or its body
            exceeds ``max_body_size`` (the message names the file and the line); or the file
            holds no jobs.
    """
    if path is None:
        text = resources.files("retrysafe.demo").joinpath("jobs.jsonl").read_text("utf-8")
        name = "bundled jobs.jsonl"
    else:
        name = str(path)
        text = _read_text(Path(path), name)
    suffix = f"~{copies - 1}" if copies > 1 else ""
    jobs: list[dict[str, Any]] = []
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
        size = _encoded_size(job_body({**job, "job_id": f"{job['job_id']}{suffix}"}, _LONGEST_TAG))
        if size > max_body_size:
            raise ConfigurationError(
                f"{name}, line {lineno}: the job's body is {size} bytes, over the service's "
                f"limit of {max_body_size} bytes",
                option="jobs-file",
            )
        jobs.append(job)
    if not jobs:
        raise ConfigurationError(f"{name} holds no jobs", option="jobs-file")
    return jobs


def _read_text(path: Path, name: str) -> str:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigurationError(f"jobs file {name} does not exist", option="jobs-file") from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigurationError(
            f"cannot read jobs file {name}: {reason}", option="jobs-file"
        ) from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigurationError(
            f"{name} is not UTF-8 text (byte {exc.start}, line {line})", option="jobs-file"
        ) from None


def cycle_jobs(jobs: Sequence[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The first ``count`` jobs of ``jobs`` repeated: copy ``k`` ≥ 1 gets ``job_id`` ``ID~k``.

    Raises:
        ConfigurationError: ``count`` < 1 or no jobs.
    """
    if count < 1:
        raise ConfigurationError("--jobs must be at least 1", option="jobs")
    if not jobs:
        raise ConfigurationError("no jobs to run", option="jobs-file")
    cycled = []
    for i in range(count):
        job = dict(jobs[i % len(jobs)])
        if i >= len(jobs):
            job["job_id"] = f"{job['job_id']}~{i // len(jobs)}"
        cycled.append(job)
    return cycled


def load_jobs(
    path: str | Path | None, count: int, *, max_body_size: int = MAX_BODY_SIZE
) -> list[dict[str, Any]]:
    """Read ``count`` jobs from ``path`` or the bundled file: :func:`read_jobs`, then
    :func:`cycle_jobs`.

    When the file has fewer jobs than ``count`` it is cycled, each copy getting a distinct
    ``job_id`` suffix (``~1``, ``~2`` …), so any size of run is possible from a short file.

    Raises:
        ConfigurationError: as :func:`read_jobs` and :func:`cycle_jobs`.
    """
    if count < 1:
        raise ConfigurationError("--jobs must be at least 1", option="jobs")
    # Cheap upper bound on the copies, for the size check: count copies of a 1-line file.
    jobs = read_jobs(path, max_body_size=max_body_size, copies=count)
    return cycle_jobs(jobs, count)
