"""The demo's job set: the bundled ``jobs.jsonl`` or the user's own file.

A jobs file is JSON Lines: one JSON object per line, blank lines skipped. Any object is a job.
Its optional ``job_id`` names the operation (default ``line-N``); everything in it is sent as
the body of ``POST /posts``, with an ``operation`` field (``naive:<job_id>`` or
``retrysafe:<job_id>``) added so the effect ledger can count posts per operation.

The whole file is checked before the demo starts anything: every line a JSON object with no
``NaN``/``Infinity`` (not JSON, and no service could receive it), every ``job_id`` a distinct
string or integer that does not end in ``~N`` (the names the demo gives to the copies it makes
when it cycles the file), every body within the service's limit.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from retrysafe._exceptions import ConfigurationError
from retrysafe.server import IdempotencyConfig

__all__ = ["MAX_BODY_SIZE", "MAX_JOB_ID", "cycle_jobs", "job_body", "load_jobs", "read_jobs"]

#: The largest request body, in bytes, the demo's idempotency middleware accepts (its default);
#: a larger keyed request gets ``413`` and is never published.
MAX_BODY_SIZE = IdempotencyConfig().max_body_size

# The longest operation tag job_body() adds, for the size check.
_LONGEST_TAG = "retrysafe"

#: The longest ``job_id`` a jobs file may give, in characters.
MAX_JOB_ID = 200

# The suffix cycle_jobs() gives to copies: a job_id ending in it could collide with a copy.
_COPY_SUFFIX = re.compile(r"~[0-9]+\Z")


class _LineError(ValueError):
    """A problem with one line of a jobs file; the message is the problem alone."""


def _no_constant(name: str) -> Any:
    raise _LineError(f"{name} is not valid JSON (and no service could receive it)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _LineError(f"the number {_shown(text, 40)} is too large for a JSON body")
    return value


def _shown(text: str, limit: int = 120) -> str:
    """``text`` for an error message: at most ``limit`` characters, its middle elided."""
    if len(text) <= limit:
        return text
    head = (limit - 1) * 2 // 3
    return f"{text[:head]}…{text[-(limit - 1 - head) :]}"


def _parse_line(line: str) -> Any:
    try:
        return json.loads(line, parse_constant=_no_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        what = exc.msg.removesuffix(" at")  # "Unterminated string starting at"
        raise _LineError(f"not valid JSON ({what} at column {exc.colno})") from None
    except RecursionError:
        raise _LineError("JSON nested too deeply") from None
    except _LineError:
        raise
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise _LineError(f"not valid JSON ({_shown(str(exc), 80)})") from None


def _job_id(job: dict[str, Any], lineno: int) -> str:
    """The job's id as text (``line-N`` by default); the job gets it as ``job_id``."""
    if "job_id" not in job:
        job["job_id"] = f"line-{lineno}"
    value = job["job_id"]
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _LineError(f"job_id must be a string or an integer, got {type(value).__name__}")
    text = str(value)
    if not text.strip():
        raise _LineError("job_id is empty")
    if len(text) > MAX_JOB_ID:
        raise _LineError(f"job_id is {len(text)} characters long, over {MAX_JOB_ID}")
    if not text.isprintable():
        raise _LineError(f"job_id {_shown(text)!r} contains control characters")
    if _COPY_SUFFIX.search(text):
        raise _LineError(
            f"job_id {_shown(text)!r} ends in ~N, which the demo reserves for the copies it "
            "makes when it cycles the file"
        )
    return text


def _check_text(job: dict[str, Any]) -> None:
    """Every string of ``job`` is Unicode text: JSON's ``\\ud800`` escape reads as a lone
    surrogate, which passed here and failed the run when the outbox recorded the job (after
    the naive pass, exit 1 instead of 2)."""
    try:
        json.dumps(job, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        lone = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
        raise _LineError(
            f"a string holds {lone}, a lone surrogate (half of a UTF-16 pair): no text"
        ) from None


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
        ConfigurationError (``option="jobs-file"``): the path is empty; the file is missing,
            unreadable or not UTF-8 (the message gives the byte offset); a line is not a JSON
            object, holds ``NaN``/``Infinity``, has a ``job_id`` that is not a string or an
            integer, repeats an earlier line's or ends in ``~N`` (reserved for copies), or its
            body exceeds ``max_body_size`` (the message names the file, the line and the
            problem); or the file holds no jobs.
    """
    if path is None:
        text = resources.files("retrysafe.demo").joinpath("jobs.jsonl").read_text("utf-8")
        name = "bundled jobs.jsonl"
    else:
        if not str(path).strip():
            raise ConfigurationError("the jobs file's path is empty", option="jobs-file")
        name = _shown(str(path), 300)
        text = _read_text(Path(path), name)
    suffix = f"~{copies - 1}" if copies > 1 else ""
    jobs: list[dict[str, Any]] = []
    first_line: dict[str, int] = {}
    # JSON Lines ends lines with "\n" (an optional "\r" before it) only: U+2028 or U+0085 are
    # characters of a string, as json.dumps(ensure_ascii=False) writes them.
    for lineno, raw in enumerate(text.split("\n"), 1):
        line = raw.removesuffix("\r")
        if not line.strip():
            continue
        try:
            job = _parse_line(line)
            if not isinstance(job, dict):
                raise _LineError(f"expected a JSON object, got {type(job).__name__}")
            _check_text(job)
            default = "job_id" not in job
            job_id = _job_id(job, lineno)
            if job_id in first_line:
                what = "its default job_id" if default else "job_id"
                raise _LineError(
                    f"{what} {_shown(job_id)!r} is already used on line {first_line[job_id]} "
                    "(each job needs its own id: the demo counts posts per job)"
                )
            size = _encoded_size(job_body({**job, "job_id": f"{job_id}{suffix}"}, _LONGEST_TAG))
            if size > max_body_size:
                raise _LineError(
                    f"the job's body is {size} bytes, over the service's limit of "
                    f"{max_body_size} bytes"
                )
        except _LineError as exc:
            raise ConfigurationError(f"{name}, line {lineno}: {exc}", option="jobs-file") from None
        first_line[job_id] = lineno
        jobs.append(job)
    if not jobs:
        raise ConfigurationError(f"{name} holds no jobs", option="jobs-file")
    return jobs


def _read_text(path: Path, name: str) -> str:
    try:
        if path.exists() and not path.is_file():
            raise ConfigurationError(f"jobs file {name} is not a regular file", option="jobs-file")
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
