"""Query-string and form values, checked: every bad value is a :class:`BadInput` naming the
parameter, what it must be and (clipped) what came, and the page answers 400 with that
sentence. Nothing here touches the store."""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Mapping, Sequence

from retrysafe.client._models import JobState
from retrysafe.ui._data import JobFilter, Position

__all__ = [
    "DEFAULT_LIMIT",
    "MAX_IDS",
    "MAX_LIMIT",
    "BadInput",
    "clip",
    "form_value",
    "parse_host",
    "parse_ids",
    "parse_job_filter",
    "parse_limit",
    "parse_position",
    "parse_run_id",
    "parse_states",
    "parse_time",
]

DEFAULT_LIMIT = 50
MAX_LIMIT = 500
#: The most items one action takes (a bulk action beyond it is split by the operator).
MAX_IDS = 500
#: Job, delivery and endpoint ids: what the package generates (hex, ``ep_`` + hex) and what a
#: caller may give (``submit(job_id=…)``): visible ASCII without separators, bounded.
_ID = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
#: Characters no host name holds (URL delimiters and markup).
_NOT_IN_HOST = set("/?#@<>\"'`\\[]%")


class BadInput(ValueError):
    """A query or form value that cannot be used. ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def clip(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters (with an ellipsis)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _one(query: Mapping[str, Sequence[str]], name: str) -> str | None:
    values = query.get(name) or []
    if len(values) > 1:
        raise BadInput(name, "give it once")
    value = values[0].strip() if values else ""
    return value or None


def parse_limit(query: Mapping[str, Sequence[str]]) -> int:
    """``limit``: rows per page, 1–500 (default 50)."""
    text = _one(query, "limit")
    if text is None:
        return DEFAULT_LIMIT
    if len(text) > 6 or not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_LIMIT:
        raise BadInput(
            "limit", f"must be a whole number from 1 to {MAX_LIMIT} (got {clip(text)!r})"
        )
    return int(text)


_POSITION_TIME = re.compile(r"[0-9]{1,12}(\.[0-9]{1,20})?")

#: 10000-01-01T00:00:00Z in Unix seconds: no keyset position is at or after it.
_YEAR_10000 = 253402300800.0


def parse_position(query: Mapping[str, Sequence[str]]) -> Position | None:
    """``after``: the keyset position a "next page" link carries (``<created_at>_<id>``)."""
    text = _one(query, "after")
    if text is None:
        return None
    at, sep, ident = text.partition("_")
    # Only what the console writes (repr of a Unix time: ASCII digits, a fraction):
    # not "1e5", "+1" or other digits float() would take.
    when = float(at) if _POSITION_TIME.fullmatch(at) else math.nan
    # A page's last row was created between 1970 and 9999 (the times the console shows).
    if not sep or not 0 <= when < _YEAR_10000 or not _ID.fullmatch(ident):
        raise BadInput(
            "after",
            f"{clip(text)!r} is not a page position of this console (follow the page's "
            "own \u201cnext\u201d link, or drop it to start at the newest)",
        )
    return Position(when, ident)


def parse_states(
    query: Mapping[str, Sequence[str]], allowed: Sequence[JobState] = tuple(JobState)
) -> tuple[JobState, ...]:
    """``state`` (repeatable): job states, by value (``unknown``) or name (``UNKNOWN``)."""
    out: list[JobState] = []
    for raw in query.get("state") or []:
        text = raw.strip().lower()
        if not text:
            continue
        try:
            state = JobState(text)
        except ValueError:
            state = None
        if state is None or state not in allowed:
            names = ", ".join(s.value for s in allowed)
            raise BadInput("state", f"{clip(raw)!r} is not one of {names}")
        if state not in out:
            out.append(state)
    return tuple(out)


def parse_time(query: Mapping[str, Sequence[str]], name: str) -> float | None:
    """An ISO 8601 date or date-time (``2026-12-01``, ``2026-12-01T14:00``, with an offset or
    ``Z``; without one it is UTC, as the console shows every time) → Unix seconds."""
    text = _one(query, name)
    if text is None:
        return None
    try:
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        moment = None
    if moment is None:
        raise BadInput(name, f"{clip(text)!r} is not a date-time such as 2026-12-01T14:00 (UTC)")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    at = moment.timestamp()
    # In UTC, as the console shows it: 9999-12-31T23:59-14:00 is already year 10000.
    if not 0 <= at < _YEAR_10000:
        raise BadInput(name, f"{clip(text)!r} is outside the years 1970–9999 UTC (no job is)")
    return at


def parse_queue(value: str | None) -> str:
    """A queue name (default ``default``), by the outbox's own rule (``check_queue``)."""
    from retrysafe._exceptions import ConfigurationError
    from retrysafe.client._jobs import check_queue

    if value is None:
        return "default"
    try:
        return check_queue(value)
    except ConfigurationError:
        raise BadInput(
            "queue", f"{clip(value)!r} is not a queue name (a-z 0-9 _ . -, up to 64)"
        ) from None


def parse_job_filter(query: Mapping[str, Sequence[str]]) -> JobFilter:
    """The jobs page's filters: ``queue``, ``state``, ``host``, ``since``, ``until``."""
    queue = parse_queue(_one(query, "queue"))
    text = _one(query, "host")
    host, port = (None, None) if text is None else parse_host(text)
    since, until = parse_time(query, "since"), parse_time(query, "until")
    if since is not None and until is not None and until <= since:
        raise BadInput("until", "must be later than since")
    return JobFilter(
        queue=queue, states=parse_states(query), host=host, port=port, since=since, until=until
    )


def parse_host(text: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` → ``(name, port or None)`` as the
    jobs store their destination: lower case, an IPv6 literal without its brackets, a
    non-ASCII name as typed (``bücher.example``)."""
    value = text.strip().lower()
    port = ""
    if value.startswith("["):
        inside, close, rest = value[1:].partition("]")
        if not close or (rest and not re.fullmatch(r":[0-9]{1,5}", rest)):
            raise BadInput("host", f"{clip(text)!r} is not a host or host:port")
        name, port = inside, rest[1:]
        if not re.fullmatch(r"[0-9a-f:.]+", name):
            raise BadInput("host", f"{clip(text)!r} is not a host or host:port")
    elif value.count(":") > 1:  # an IPv6 literal without brackets: no port can follow
        name = value
        if not re.fullmatch(r"[0-9a-f:.]+", name):
            raise BadInput("host", f"{clip(text)!r} is not a host or host:port")
    else:
        name, sep, tail = value.rpartition(":")
        if not sep:
            name, port = value, ""
        elif tail.isascii() and tail.isdigit():
            port = tail
        else:  # "host:-1", "host:", "host:x": a port that is not one, never part of a name
            raise BadInput("host", f"{clip(text)!r} is not a host or host:port")
        if (
            not name
            or len(name) > 253
            or any(c.isspace() or c in _NOT_IN_HOST or not c.isprintable() for c in name)
        ):
            raise BadInput("host", f"{clip(text)!r} is not a host or host:port")
    if port and not 0 < int(port[:6]) < 65536:
        raise BadInput("host", f"{clip(text)!r}: the port must be 1–65535")
    return name, int(port) if port else None


def parse_run_id(value: str) -> str:
    """An agent run id: 1–255 visible ASCII characters (SPEC §2, as ``start_run`` takes)."""
    if not 0 < len(value) <= 255 or any(not 33 <= ord(c) <= 126 for c in value):
        raise BadInput("id", f"{clip(value)!r} is not an agent run id")
    return value


def form_value(form: Mapping[str, Sequence[str]], name: str) -> str | None:
    """One value of a form field (None when absent); a repeated field is a
    :class:`BadInput` — an action never guesses which of two values was meant."""
    values = form.get(name) or []
    if len(values) > 1:
        raise BadInput(name, "give it once")
    return values[0] if values else None


def parse_id(value: str, what: str = "id") -> str:
    """One job, delivery, endpoint or run id as it appears in a URL or a form."""
    if not _ID.fullmatch(value):
        raise BadInput(what, f"{clip(value)!r} is not an id")
    return value


def parse_ids(form: Mapping[str, Sequence[str]]) -> list[str]:
    """``id`` (repeatable): 1–500 distinct ids, in the order given."""
    seen: list[str] = []
    for raw in form.get("id") or []:
        ident = parse_id(raw.strip(), "id")
        if ident not in seen:
            seen.append(ident)
    if not seen:
        raise BadInput("id", "choose at least one item")
    if len(seen) > MAX_IDS:
        raise BadInput("id", f"at most {MAX_IDS} items per action (got {len(seen)})")
    return seen
