"""A demo jobs file is checked whole before anything starts: exit 2, one line naming the file,
the line and the problem (help of `retrysafe demo --jobs-file`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from retrysafe import ConfigurationError
from retrysafe.demo import MAX_JOB_ID, DemoOptions, load_jobs, read_jobs, run_demo


def _write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _refused(path: Path, count: int = 1) -> str:
    with pytest.raises(ConfigurationError) as caught:
        load_jobs(path, count)
    assert caught.value.option == "jobs-file"
    return str(caught.value)


@pytest.mark.parametrize(
    ("lines", "line", "problem"),
    [
        (['{"job_id": "a"}', '{"job_id": "b"}', '{"job_id": "a"}'], 3, "already used on line 1"),
        (['{"job_id": "line-2"}', '{"text": "no id"}'], 2, "its default job_id 'line-2'"),
        (['{"job_id": 7}', '{"job_id": "7"}'], 2, "already used on line 1"),
        (['{"job_id": "a"}', '{"job_id": "a~1"}'], 2, "ends in ~N"),
        (['{"job_id": "b~12"}'], 1, "ends in ~N"),
        (['{"job_id": "a", "score": NaN}'], 1, "NaN is not valid JSON"),
        (['{"job_id": "a", "score": [1, Infinity]}'], 1, "Infinity is not valid JSON"),
        (['{"job_id": "a", "score": -Infinity}'], 1, "-Infinity is not valid JSON"),
        (['{"job_id": "a", "score": 1e999}'], 1, "too large"),
        (['{"job_id": "a", "n": ' + "9" * 5000 + "}"], 1, "not valid JSON"),
        (["[" * 100_000 + "]" * 100_000], 1, "nested too deeply"),
        (['{"job_id": null}'], 1, "job_id must be a string or an integer, got NoneType"),
        (['{"job_id": true}'], 1, "job_id must be a string or an integer, got bool"),
        (['{"job_id": ["a"]}'], 1, "job_id must be a string or an integer, got list"),
        (['{"job_id": "  "}'], 1, "job_id is empty"),
        (['{"job_id": "a\\nb"}'], 1, "control characters"),
        ([f'{{"job_id": "{"x" * (MAX_JOB_ID + 1)}"}}'], 1, f"over {MAX_JOB_ID}"),
        # Lone surrogates passed, and failed the run when the outbox recorded the job.
        (['{"job_id": "a", "x": {"y": ["\\ud800"]}}'], 1, "\\ud800, a lone surrogate"),
        (['{"job_id": "\\udfff"}'], 1, "\\udfff, a lone surrogate"),
    ],
    ids=[
        "duplicate", "default-collides", "int-and-str", "copy-name", "copy-name-alone", "nan",
        "infinity", "minus-infinity", "overflow", "huge-int", "deep", "null-id", "bool-id",
        "list-id", "blank-id", "control-id", "long-id", "surrogate", "surrogate-id",
    ],
)  # fmt: skip
def test_bad_job_is_refused_naming_file_line_and_problem(
    tmp_path: Path, lines: list[str], line: int, problem: str
) -> None:
    """Duplicate ids, ids that a copy would take, NaN/Infinity and other impossible values
    are refused with 'FILE, line N: problem'."""
    path = _write(tmp_path / "jobs.jsonl", *lines)
    message = _refused(path)
    assert message.startswith(f"{path}, line {line}: ")
    assert problem in message
    assert "\n" not in message


def test_the_whole_file_is_checked_even_beyond_jobs(tmp_path: Path) -> None:
    """A bad line after the first --jobs lines is still refused: the file is checked whole."""
    path = _write(tmp_path / "jobs.jsonl", '{"job_id": "a"}', '{"job_id": "b", "x": NaN}')
    assert "line 2: NaN" in _refused(path, count=1)


def test_a_file_that_is_not_regular_is_refused() -> None:
    """/dev/zero is never read (it would fill the memory): not a regular file."""
    with pytest.raises(ConfigurationError, match="is not a regular file"):
        read_jobs("/dev/zero")


def test_distinct_ids_and_integers_are_accepted(tmp_path: Path) -> None:
    """Integer ids, ids with '~' inside and a short file to cycle are fine."""
    path = _write(tmp_path / "jobs.jsonl", '{"job_id": 1}', '{"job_id": "a~b"}', "{}")
    jobs = load_jobs(path, 5)
    assert [str(j["job_id"]) for j in jobs] == ["1", "a~b", "line-3", "1~1", "a~b~1"]


def test_run_demo_refuses_jobs_sharing_an_id_before_starting() -> None:
    """Jobs given to run_demo that share a job_id are refused before any thread starts."""
    before = threading.active_count()
    with pytest.raises(ConfigurationError, match="'a' is used twice"):
        run_demo(DemoOptions(jobs=2, naive=False), jobs=[{"job_id": "a"}, {"job_id": "a"}])
    assert threading.active_count() == before


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('{"job_id": "a"}\n{"job_id": "a"}\n', "line 2: job_id 'a' is already used on line 1"),
        ('{"job_id": "a"}\n{"job_id": "a~1"}\n', "line 2: job_id 'a~1' ends in ~N"),
        ('{"job_id": "a", "v": NaN}\n', "line 1: NaN is not valid JSON"),
    ],
    ids=["duplicate", "copy-name", "nan"],
)
def test_cli_refuses_the_file_with_one_line_before_starting(
    tmp_path: Path, content: str, problem: str
) -> None:
    """`retrysafe demo --jobs-file` with a bad job: exit 2, exactly one line naming the option,
    the file, the line and the problem; no banner, no traceback, no temporary directory."""
    path = tmp_path / "jobs.jsonl"
    path.write_text(content, encoding="utf-8")
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "retrysafe", "demo", "--jobs-file", str(path), "--jobs", "4"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(private_tmp)},
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"retrysafe: error: --jobs-file: {path}, {problem}")
    assert out.stdout == ""
    assert list(private_tmp.iterdir()) == []


def test_lines_end_at_newlines_only(tmp_path: Path) -> None:
    """U+2028 and U+0085 inside a string (json.dumps(ensure_ascii=False) writes them raw) are
    characters, not line ends; CRLF files work; line numbers count newlines."""
    import json

    path = tmp_path / "jobs.jsonl"
    first = json.dumps({"job_id": "a", "text": "one\u2028two\x85three"}, ensure_ascii=False)
    path.write_text(first + "\r\n" + '{"job_id": "b"}\r\n', encoding="utf-8")
    jobs = read_jobs(path)
    assert [j["job_id"] for j in jobs] == ["a", "b"]
    assert jobs[0]["text"] == "one\u2028two\x85three"
    path.write_text('{"job_id": "a"}\n{"job_id": "b"}\u2028{"job_id": "c"}\n', encoding="utf-8")
    with pytest.raises(ConfigurationError, match=r"line 2: not valid JSON"):
        read_jobs(path)


def test_an_unterminated_string_is_named_once() -> None:
    """The JSON error reads 'Unterminated string starting at column N' (no 'at at')."""
    from retrysafe.demo._jobs import _LineError, _parse_line

    expected = r"^not valid JSON \(Unterminated string starting at column 10\)$"
    with pytest.raises(_LineError, match=expected):
        _parse_line('{"text": "open')
