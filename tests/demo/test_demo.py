"""`retrysafe demo`: the naive client duplicates, the protected path does not (SPEC §8)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from retrysafe import ConfigurationError
from retrysafe.demo import MAX_BODY_SIZE, DemoOptions, Progress, load_jobs, run_demo


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "retrysafe", "demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
        # Wide enough that rich never folds a long temporary path in the middle of a word.
        env={**os.environ, "COLUMNS": "400"},
    )


def _flat(text: str) -> str:
    """Rich wraps stderr at 80 columns when it is not a terminal; compare word by word."""
    return " ".join(text.split())


def _write_jobs(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_naive_duplicates_and_protected_has_none() -> None:
    """At a high loss rate the naive pass duplicates posts; the outbox pass has 0 and 0."""
    result = run_demo(DemoOptions(jobs=80, loss_rate=0.3, seed=3, concurrency=8, timeout=1.0))
    assert result.naive is not None
    assert result.naive.report.duplicates > 0
    assert result.naive.report.effects > result.naive.report.operations
    protected = result.protected.report
    assert (protected.duplicates, protected.lost) == (0, 0)
    assert protected.effects == protected.operations == 80
    assert protected.succeeded == 80
    assert result.ok


def test_total_loss_is_reconciled_with_the_same_keys() -> None:
    """When every answer is lost, jobs end UNKNOWN, and reconciliation after healing succeeds
    without a single duplicate effect."""
    result = run_demo(
        DemoOptions(jobs=10, loss_rate=1.0, seed=1, concurrency=4, timeout=1.0, attempts=2)
    )
    protected = result.protected.report
    assert result.protected.extra["reconciled_jobs"] == 10
    assert protected.reconciled == 10
    assert (protected.effects, protected.duplicates, protected.lost) == (10, 0, 0)
    assert result.naive is not None
    assert result.naive.report.effects == 20  # two blind attempts, both committed


def test_demo_leaves_no_threads_behind() -> None:
    """After a run, no server, proxy or worker thread is still alive."""
    before = {t.name for t in threading.enumerate()}
    run_demo(DemoOptions(jobs=5, loss_rate=0.0, concurrency=2, naive=False))
    after = {t.name for t in threading.enumerate() if t.is_alive()}
    assert after <= before


def test_cli_json_report_and_exit_status() -> None:
    """`--json` prints a parseable report on stdout; exit 0 when the protected pass is clean."""
    out = _cli("--jobs", "30", "--loss-rate", "0.2", "--seed", "5", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["ok"] is True
    assert doc["retrysafe"]["report"]["duplicates"] == 0
    assert doc["retrysafe"]["report"]["lost"] == 0
    assert doc["naive"]["report"]["operations"] == 30
    assert doc["options"]["loss_rate"] == 0.2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--loss-rate", "1.5"], "loss-rate"),
        (["--loss-rate", "-0.1"], "loss-rate"),
        (["--jobs", "0"], "jobs"),
        (["--concurrency", "0"], "concurrency"),
        (["--jobs-file", "/no/such/file.jsonl"], "file.jsonl"),
    ],
)
def test_cli_bad_options_are_clear_errors(args: list[str], needle: str) -> None:
    """Out-of-range options and missing files: a message naming the problem, non-zero exit."""
    out = _cli(*args)
    assert out.returncode != 0
    assert needle in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"jobs": "5"}, "jobs"),
        ({"jobs": True}, "jobs"),
        ({"jobs": 5.0}, "jobs"),
        ({"jobs": 100_001}, "jobs"),
        ({"loss_rate": "0.1"}, "loss-rate"),
        ({"loss_rate": float("nan")}, "loss-rate"),
        ({"loss_rate": True}, "loss-rate"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**32}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"concurrency": 1.5}, "concurrency"),
        ({"concurrency": 1025}, "concurrency"),
        ({"timeout": 0.01}, "timeout"),
        ({"timeout": "2"}, "timeout"),
        ({"timeout": float("inf")}, "timeout"),
        ({"attempts": 51}, "attempts"),
        ({"attempts": None}, "attempts"),
        ({"naive": "no"}, None),
        ({"jobs_file": 5}, "jobs-file"),
    ],
)
def test_options_out_of_the_clis_ranges_are_refused_by_the_api(
    options: dict[str, Any], option: str | None
) -> None:
    """``DemoOptions`` refuses what ``retrysafe demo`` refuses, with a ConfigurationError
    naming the option (a string for ``jobs`` was a TypeError; ``seed=-1`` and
    ``concurrency=1.5`` ran)."""
    with pytest.raises(ConfigurationError) as caught:
        DemoOptions(**options)
    assert caught.value.option == option


def test_the_clis_ranges_are_the_apis() -> None:
    """The CLI mirrors the demo's limits (it does not import them, so --help stays fast):
    both ends of every range are accepted by both, one step beyond by neither."""
    from retrysafe.cli import _demo as cli
    from retrysafe.client._policy import MAX_CONCURRENCY
    from retrysafe.demo import _run as api

    assert (cli._MAX_JOBS, cli._MAX_SEED, cli._MAX_CONCURRENCY, cli._MAX_ATTEMPTS) == (
        api.MAX_JOBS,
        api.MAX_SEED,
        MAX_CONCURRENCY,
        api.MAX_ATTEMPTS,
    )
    assert (cli._MIN_TIMEOUT, cli._MAX_TIMEOUT) == (api.MIN_TIMEOUT, api.MAX_TIMEOUT)
    DemoOptions(jobs=api.MAX_JOBS, seed=api.MAX_SEED, concurrency=MAX_CONCURRENCY)
    DemoOptions(jobs=1, seed=0, concurrency=1, attempts=1, timeout=api.MIN_TIMEOUT)
    DemoOptions(attempts=api.MAX_ATTEMPTS, timeout=api.MAX_TIMEOUT, loss_rate=1)


def test_cli_malformed_jobs_file_names_the_line(tmp_path: Path) -> None:
    """A bad line in --jobs-file is reported with its line number; nothing runs."""
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"job_id": "a", "text": "ok"}\n{"job_id": "b", "text": \n', encoding="utf-8")
    out = _cli("--jobs-file", str(jobs), "--jobs", "2")
    assert out.returncode != 0
    assert "line 2" in out.stderr
    assert "Traceback" not in out.stderr


def test_bundled_jobs_cycle_with_distinct_ids() -> None:
    """More jobs than the bundled file holds: copies get distinct job ids."""
    jobs = load_jobs(None, 2500)
    ids = [j["job_id"] for j in jobs]
    assert len(set(ids)) == 2500
    assert {len(j["text"]) for j in jobs[:1000]} != {len(jobs[0]["text"])}  # varied sizes


@pytest.mark.parametrize(
    "content",
    ["", "\n\n", "[1, 2]\n", "42\n", "not json\n"],
    ids=["empty", "blank", "list", "number", "text"],
)
def test_jobs_file_without_job_objects_is_refused(tmp_path: Path, content: str) -> None:
    """Empty files and lines that are not JSON objects raise ConfigurationError."""
    path = tmp_path / "jobs.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigurationError):
        load_jobs(path, 3)


def test_total_loss_run_prints_no_traceback() -> None:
    """Every answer lost, short timeouts: exit 0 and nothing on stderr looks like a traceback."""
    out = _cli("--loss-rate", "1", "--jobs", "10", "--attempts", "2", "--timeout", "0.5")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "Exception in callback" not in out.stderr


def test_jobs_file_with_a_body_over_the_service_limit_is_refused(tmp_path: Path) -> None:
    """A job whose body exceeds the middleware's limit is refused, naming file, line and limit."""
    path = _write_jobs(
        tmp_path / "jobs.jsonl", '{"text": "ok"}', json.dumps({"text": "x" * MAX_BODY_SIZE})
    )
    with pytest.raises(ConfigurationError) as caught:
        load_jobs(path, 2)
    message = str(caught.value)
    assert f"{path}, line 2" in message
    assert f"{MAX_BODY_SIZE} bytes" in message


def test_protected_pass_that_publishes_nothing_is_not_ok() -> None:
    """Jobs the service rejects (413) leave duplicates and lost at 0, yet the demo fails."""
    big = {"job_id": "big", "text": "x" * (MAX_BODY_SIZE + 1)}
    result = run_demo(
        DemoOptions(jobs=2, loss_rate=0.0, naive=False, concurrency=2),
        jobs=[big, {**big, "job_id": "big~1"}],
    )
    report = result.protected.report
    assert (report.duplicates, report.lost, report.rejected, report.effects) == (0, 0, 2, 0)
    assert not result.ok
    assert result.to_dict()["ok"] is False
    assert any("REJECTED" in reason for reason in result.failures)


def test_jobs_file_that_is_not_utf8_names_the_byte(tmp_path: Path) -> None:
    """Invalid UTF-8 is reported as 'FILE is not UTF-8 text (byte N …', not a codec error."""
    path = tmp_path / "jobs.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": "\xff"}\n')
    with pytest.raises(ConfigurationError, match=r"is not UTF-8 text \(byte 16, line 2\)"):
        load_jobs(path, 1)


def test_cli_jobs_file_errors_come_before_the_banner(tmp_path: Path) -> None:
    """A missing jobs file exits 2 with one error line naming the option; the demo never
    announces itself."""
    out = _cli("--jobs-file", str(tmp_path / "missing.jsonl"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"retrysafe: error: --jobs-file: jobs file {tmp_path / 'missing.jsonl'} does not exist"
    ]


def test_cli_banner_says_when_the_jobs_file_is_cycled(tmp_path: Path) -> None:
    """A 2-line jobs file run with --jobs 4 is announced as '2 jobs from FILE, cycled to 4'."""
    path = _write_jobs(tmp_path / "jobs.jsonl", '{"job_id": "a"}', '{"text": "no id"}')
    out = _cli("--jobs-file", str(path), "--jobs", "4", "--loss-rate", "0", "--no-naive")
    assert out.returncode == 0, out.stderr
    assert f"2 jobs from {path}, cycled to 4" in _flat(out.stderr)


def test_progress_notes_say_why_the_demo_waits() -> None:
    """Between phases the demo announces what it does, e.g. reconciling the UNKNOWN jobs."""
    notes: list[str] = []

    class Notes(Progress):
        def note(self, message: str) -> None:
            notes.append(message)

    run_demo(DemoOptions(jobs=3, loss_rate=1.0, naive=False, attempts=1, timeout=0.5), Notes())
    assert "healing the link, reconciling 3 UNKNOWN jobs with their same keys" in notes


def test_cli_sigterm_stops_cleanly_and_removes_the_temporary_directory(tmp_path: Path) -> None:
    """SIGTERM mid-run: one clear line, exit 143, no traceback, no retrysafe-demo-* left."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "demo", "--jobs", "200", "--loss-rate", "0.5",
         "--timeout", "0.5"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(private_tmp), "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        seen: list[str] = []
        deadline = time.monotonic() + 60
        while not any(line.startswith("naive client") for line in seen):
            assert time.monotonic() < deadline and proc.poll() is None, seen
            seen.append(proc.stderr.readline())
        assert list(private_tmp.glob("retrysafe-demo-*"))  # the run's files exist now
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143
    assert "Traceback" not in rest
    assert "retrysafe: error: terminated (SIGTERM)" in rest
    assert list(private_tmp.iterdir()) == []


@pytest.mark.parametrize(
    ("closed", "extra"), [("stdout", ()), ("stdout", ("--json",)), ("stderr", ())]
)
def test_a_closed_pipe_drops_output_and_the_demo_exits_by_its_verdict(
    closed: str, extra: tuple[str, ...]
) -> None:
    """``retrysafe demo | head -1`` and ``… 2>&1 | head -1``: once the reader is gone, what
    is left to write is dropped without a traceback, and the exit status is still the
    verdict (0 here), never 1, which means duplicates or lost jobs."""
    read, write = os.pipe()
    os.close(read)  # nobody will ever read: every write to it is EPIPE
    streams: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    streams[closed] = write
    try:
        done = subprocess.run(
            [sys.executable, "-m", "retrysafe", "demo", "--jobs", "20", *extra],
            timeout=120,
            check=False,
            text=True,
            **streams,
        )
    finally:
        os.close(write)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in (done.stderr or "")


def test_a_workdir_that_does_not_exist_is_refused_and_not_made(tmp_path: Path) -> None:
    """`run_demo(workdir=…)` takes an existing directory; a missing one was created, parents
    and all (a fresh-user pass). A file is no directory either."""
    missing = tmp_path / "no" / "such"
    with pytest.raises(ConfigurationError, match="not an existing directory") as info:
        run_demo(DemoOptions(jobs=5), workdir=missing)
    assert info.value.option == "workdir"
    assert not (tmp_path / "no").exists()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigurationError, match="not an existing directory"):
        run_demo(DemoOptions(jobs=5), workdir=a_file)
