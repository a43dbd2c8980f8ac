"""`retrysafe demo` refuses bad option values: exit 2, one short line naming the option, and
nothing started (no service, no temporary directory)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import retrysafe.demo
from retrysafe.cli import cli

BIG_DIGITS = "9" * (10 * 1024 * 1024)
BIG_TEXT = "x" * (10 * 1024 * 1024)
BAD = {"empty": "", "nan": "nan", "inf": "inf", "negative": "-1", "10MB-digits": BIG_DIGITS,
       "10MB-text": BIG_TEXT}  # fmt: skip
OPTIONS = ["--jobs", "--loss-rate", "--seed", "--concurrency", "--jobs-file", "--timeout",
           "--attempts"]  # fmt: skip


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Any demo that gets past its checks fails the test; temporary files go to the returned
    (empty) directory."""

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started")

    monkeypatch.setattr(retrysafe.demo, "run_demo", started)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("option", OPTIONS)
def test_bad_value_exits_2_with_one_line_naming_the_option(
    nothing_starts: Path, option: str, value: str
) -> None:
    """Empty, NaN, infinite, negative and 10 MB values: exit 2, one line of at most 1000
    characters that names the option, no temporary directory."""
    result = CliRunner().invoke(cli, ["demo", option, value])
    assert result.exit_code == 2, (result.exception, result.stderr[-300:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[:2000]
    assert lines[0].startswith(f"retrysafe: error: {option}")
    assert len(lines[0]) <= 1000
    assert list(nothing_starts.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--jobs", "100001"], "--jobs"),
        (["--timeout", "0.01"], "--timeout"),
        (["--timeout", "3601"], "--timeout"),
        (["--loss-rate", "1.01"], "--loss-rate"),
        (["--seed", str(2**32)], "--seed"),
    ],
)
def test_values_beyond_the_limits_are_refused(
    nothing_starts: Path, args: list[str], problem: str
) -> None:
    """A million jobs, a timeout of 10 ms or over an hour, a rate over 1, a seed over 2**32-1:
    exit 2 naming the option."""
    result = CliRunner().invoke(cli, ["demo", *args])
    assert result.exit_code == 2, (result.exception, result.stderr)
    assert result.stderr.startswith(f"retrysafe: error: {problem}")


@pytest.mark.parametrize("value", ["0", "0.001"])
def test_a_timeout_under_the_minimum_states_the_range_that_holds(
    nothing_starts: Path, value: str
) -> None:
    """`--timeout 0` stated the range as 0 < x ≤ 3600, and 0.001 was then refused as below
    0.05 (a fresh-user pass): both state the range that holds."""
    result = CliRunner().invoke(cli, ["demo", "--timeout", value])
    assert result.exit_code == 2, result.stderr
    assert "is not in the range 0.05 ≤ x ≤ 3600 (seconds)" in result.stderr
