"""`retrysafe demo`: the naive client duplicates, the protected path does not (SPEC §8)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from retrysafe import ConfigurationError
from retrysafe.demo import DemoOptions, load_jobs, run_demo


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "retrysafe", "demo", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


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
