"""The effect ledger: what really happened on the server side, per logical operation (SPEC §8).

A server's handler calls :meth:`EffectLedger.record` exactly where its side effect commits (the
post is published, the card charged). The ledger never trusts the client: comparing its counts
with what each client believes is how :func:`retrysafe.chaos.build_report` finds duplicates and
lost operations.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrysafe._exceptions import ConfigurationError

__all__ = ["Effect", "EffectLedger"]

log = logging.getLogger("retrysafe.chaos")


@dataclass(frozen=True, slots=True)
class Effect:
    """One committed effect.

    Attributes:
        operation_id: the logical operation it belongs to.
        ts: wall-clock time of the commit, seconds since the epoch.
        detail: whatever the server chose to record (JSON-serialisable when persisted).
    """

    operation_id: str
    ts: float
    detail: Mapping[str, Any] = field(default_factory=dict)


class EffectLedger:
    """Counts effects per logical operation; thread-safe.

    In memory by default (safe across threads of one process). With ``path``, every effect is
    also appended to a JSONL file with one ``write`` on a file opened in append mode, so several
    processes on one host can share a ledger: each process records into the same file and
    :meth:`counts` / :meth:`effects` read the file, which holds every process's effects. Lines
    are ``{"operation_id": …, "ts": …, "detail": {…}}``.

    Args:
        path: optional JSONL file shared across processes; created if missing, appended to if
            present (existing lines count).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._effects: list[Effect] = []  # memory: every effect; file: those read so far
        self._counts: Counter[str] = Counter()  # effects per operation, as far as known
        self._offset = 0  # file: bytes read so far (whole lines only)
        self._lines = 0  # file: lines read so far (for error messages)
        self._file: tuple[int, int] | None = None  # file: (device, inode) read so far
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            if self.path.is_dir():
                raise ConfigurationError(
                    f"the effect ledger file {self.path} is a directory", option="path"
                )
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.path.touch(exist_ok=True)
            except OSError as exc:
                raise ConfigurationError(
                    f"cannot open the effect ledger file {self.path}: {exc}", option="path"
                ) from exc

    def record(self, operation_id: str, **detail: Any) -> int:
        """Record one committed effect of ``operation_id``.

        Args:
            operation_id: the logical operation (job id, idempotency key, …).
            **detail: anything worth keeping with the effect (JSON-serialisable with a file).

        Returns:
            How many effects ``operation_id`` has now, this one included (this process's view
            when the ledger is in memory; every process's with a file). A file that cannot
            be counted (a line that is no effect) never undoes a written effect: the count
            is then what could be read plus this one, and a warning is logged.

        Raises:
            OSError: the line could not be written whole (disk full): the effect is not
                recorded.
        """
        effect = Effect(operation_id, time.time(), dict(detail))
        with self._lock:
            if self.path is None:
                self._effects.append(effect)
                self._counts[operation_id] += 1
                return self._counts[operation_id]
            line = json.dumps(
                {"operation_id": operation_id, "ts": effect.ts, "detail": effect.detail},
                separators=(",", ":"),
                default=str,
            )
            data = (line + "\n").encode("utf-8")
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    data = b"\n" + data  # a torn line (a writer died mid-line) stays its own
                written = os.write(fd, data)
            finally:
                os.close(fd)
            if written != len(data):
                raise OSError(f"effect ledger {self.path}: {written} of {len(data)} bytes written")
            try:
                self._catch_up()
            except ConfigurationError as exc:
                log.warning(
                    "effect of %s recorded, but the ledger cannot be counted: %s", operation_id, exc
                )
                return self._counts[operation_id] + 1
            return self._counts[operation_id]

    def effects(self, operation_id: str | None = None) -> list[Effect]:
        """Every recorded effect in commit order, or only those of ``operation_id``."""
        with self._read():
            found = list(self._effects)
        if operation_id is not None:
            found = [e for e in found if e.operation_id == operation_id]
        return found

    def counts(self) -> dict[str, int]:
        """``{operation_id: number of effects}`` for every operation with at least one effect."""
        with self._read():
            return dict(self._counts)

    def count(self, operation_id: str) -> int:
        """How many effects ``operation_id`` has (0 if none)."""
        with self._read():
            return self._counts[operation_id]

    def total(self) -> int:
        """How many effects were recorded in all."""
        with self._read():
            return len(self._effects)

    @contextmanager
    def _read(self) -> Iterator[None]:
        """Hold the lock, the file's new lines read first (a file ledger)."""
        with self._lock:
            if self.path is not None:
                self._catch_up()
            yield

    def _catch_up(self) -> None:
        """Read the lines appended to the file since the last read (by any process): each
        read costs what was added, not the whole file. A last line without its newline is
        another process still writing it: it is read next time. Call with the lock held.

        Raises:
            ConfigurationError: a complete line that is not a ledger line (its number named).
        """
        assert self.path is not None
        try:
            fh = self.path.open("rb")
        except FileNotFoundError:  # deleted: no effects, until a file is there again
            self._restart(None)
            return
        with fh:
            stat = os.fstat(fh.fileno())
            file = (stat.st_dev, stat.st_ino)
            if file != self._file or stat.st_size < self._offset:  # replaced or truncated
                self._restart(file)
            fh.seek(self._offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1
        for raw in data[:end].splitlines(keepends=True):
            if raw.strip():
                try:
                    effect = _effect_of(json.loads(raw))
                except (ValueError, KeyError, TypeError) as exc:
                    text = raw.decode("utf-8", "replace").strip()[:200]
                    raise ConfigurationError(
                        f"{self.path}:{self._lines + 1}: not an effect ledger line: {text!r}",
                        option="path",
                    ) from exc
                self._effects.append(effect)
                self._counts[effect.operation_id] += 1
            # Past this line only once it counted: a bad line is reported again, next time.
            self._lines += 1
            self._offset += len(raw)

    def _restart(self, file: tuple[int, int] | None) -> None:
        """Forget what was read: the next read starts at the beginning of ``file``."""
        self._effects, self._counts = [], Counter()
        self._offset = self._lines = 0
        self._file = file

    def __repr__(self) -> str:
        where = str(self.path) if self.path is not None else "memory"
        return f"EffectLedger({where}, effects={self.total()})"


def _effect_of(doc: Any) -> Effect:
    """The effect of one parsed ledger line.

    Raises:
        ValueError: not ``{"operation_id": str, "ts": finite number, "detail": object}``.
    """
    if not isinstance(doc, dict):
        raise ValueError("not an object")
    op, ts, detail = doc["operation_id"], doc["ts"], doc["detail"]
    if not isinstance(op, str) or not isinstance(detail, dict):
        raise ValueError("operation_id must be a string and detail an object")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise ValueError("ts must be a finite number")
    return Effect(op, float(ts), detail)
