"""The effect ledger counts effects per logical operation, in memory or in a shared file."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from retrysafe import ConfigurationError
from retrysafe.chaos import EffectLedger


def test_record_counts_effects_per_operation() -> None:
    """record() returns the operation's count so far; counts() maps every operation to it."""
    ledger = EffectLedger()
    assert ledger.record("a") == 1
    assert ledger.record("a", attempt=2) == 2
    assert ledger.record("b") == 1
    assert ledger.counts() == {"a": 2, "b": 1}
    assert (ledger.count("a"), ledger.count("missing"), ledger.total()) == (2, 0, 3)
    assert [dict(e.detail) for e in ledger.effects("a")] == [{}, {"attempt": 2}]


def test_concurrent_records_are_all_counted() -> None:
    """Eight threads recording 250 effects each lose none of them."""
    ledger = EffectLedger()

    def work(worker: int) -> None:
        for i in range(250):
            ledger.record(f"op-{i % 10}", worker=worker)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.total() == 2000
    assert set(ledger.counts().values()) == {200}


def test_file_ledger_is_shared_between_processes(tmp_path: Path) -> None:
    """With a JSONL file, effects recorded by another process count here too."""
    path = tmp_path / "effects.jsonl"
    ledger = EffectLedger(path)
    ledger.record("a", where="here")
    code = (
        "import sys; from retrysafe.chaos import EffectLedger; "
        "l = EffectLedger(sys.argv[1]); l.record('a', where='there'); l.record('b')"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=30)
    assert ledger.counts() == {"a": 2, "b": 1}
    assert ledger.record("b") == 2
    assert EffectLedger(path).total() == 4


def test_malformed_ledger_line_names_the_file_and_line(tmp_path: Path) -> None:
    """A line that is not an effect raises ConfigurationError with file:line."""
    path = tmp_path / "effects.jsonl"
    path.write_text('{"operation_id": "a", "ts": 1.0, "detail": {}}\nnot json\n')
    with pytest.raises(ConfigurationError, match=r"effects\.jsonl:2"):
        EffectLedger(path).counts()


def test_unwritable_ledger_path_is_a_configuration_error(tmp_path: Path) -> None:
    """A ledger path under a regular file raises ConfigurationError."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigurationError):
        EffectLedger(blocker / "effects.jsonl")


def test_a_file_ledger_reads_each_line_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recording into a file ledger reads only what was appended since the last read: 200
    effects parse 200 lines, not the whole file again per effect (200 · 201 / 2)."""
    import json

    parsed: list[int] = []
    real = json.loads

    def loads(raw: Any) -> Any:
        parsed.append(1)
        return real(raw)

    monkeypatch.setattr(json, "loads", loads)  # the module the ledger parses with
    ledger = EffectLedger(tmp_path / "effects.jsonl")
    for n in range(200):
        assert ledger.record(f"op{n % 10}") == n // 10 + 1
    assert ledger.total() == 200
    assert len(parsed) == 200


def test_a_line_still_being_written_counts_once_it_is_whole(tmp_path: Path) -> None:
    """A last line without its newline (another process mid-write) is not counted yet, and is
    counted once, when it is complete; a bad line is reported again on the next read."""
    path = tmp_path / "effects.jsonl"
    ledger = EffectLedger(path)
    ledger.record("a")
    with path.open("a") as fh:
        fh.write('{"operation_id": "b", "ts": 1.0, ')
    assert ledger.counts() == {"a": 1}
    with path.open("a") as fh:
        fh.write('"detail": {}}\nnot json\n')
    for _ in range(2):
        with pytest.raises(ConfigurationError, match=r"effects\.jsonl:3"):
            ledger.counts()
    path.write_text("")  # truncated: read anew
    assert ledger.total() == 0


def test_a_replaced_or_deleted_ledger_file_is_read_anew(tmp_path: Path) -> None:
    """A file replaced under the ledger (a new inode, even a larger one) is read from its
    start; a deleted one counts nothing, and the next record starts a new file."""
    import os

    path = tmp_path / "effects.jsonl"
    ledger = EffectLedger(path)
    for op in ("old0", "old1", "old2"):
        ledger.record(op)
    other = EffectLedger(tmp_path / "other.jsonl")
    for op in ("new0", "new1", "new2", "new3"):
        other.record(op)
    os.replace(tmp_path / "other.jsonl", path)
    assert ledger.counts() == {"new0": 1, "new1": 1, "new2": 1, "new3": 1}
    path.unlink()
    assert ledger.counts() == {}
    assert ledger.record("b") == 1
    assert ledger.counts() == {"b": 1}


def test_recording_never_fails_after_its_effect_is_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bad line in the file makes counts() raise, but record() still returns (the effect is
    written: a handler must not turn it into an error and a retry) and logs a warning; a torn
    last line (a writer that died mid-line) never swallows the next effect."""
    path = tmp_path / "effects.jsonl"
    ledger = EffectLedger(path)
    ledger.record("a")
    with path.open("a") as fh:
        fh.write('{"operation_id": "de')  # torn: no newline
    assert ledger.record("b") >= 1
    assert "cannot be counted" in caplog.text
    lines = path.read_text().splitlines()
    assert lines[-1].startswith('{"operation_id":"b"')  # its own line
    with pytest.raises(ConfigurationError, match=r"effects\.jsonl:2"):
        ledger.counts()


@pytest.mark.parametrize(
    "line",
    [
        '{"operation_id": null, "ts": 1.0, "detail": {}}',
        '{"operation_id": "a", "ts": "nan", "detail": {}}',
        '{"operation_id": "a", "ts": NaN, "detail": {}}',
        '{"operation_id": "a", "ts": true, "detail": {}}',
        '{"operation_id": "a", "ts": 1.0, "detail": 5}',
        '["a", 1.0, {}]',
    ],
)
def test_a_line_of_the_wrong_shape_is_no_effect(tmp_path: Path, line: str) -> None:
    """Parseable JSON that is not {operation_id: str, ts: finite number, detail: object} is
    reported with its line, never counted under a made-up id."""
    path = tmp_path / "effects.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigurationError, match=r"effects\.jsonl:1"):
        EffectLedger(path).counts()


def test_a_directory_is_no_ledger_file(tmp_path: Path) -> None:
    """EffectLedger(a directory) is a ConfigurationError, not a raw IsADirectoryError."""
    with pytest.raises(ConfigurationError, match="is a directory"):
        EffectLedger(tmp_path)
