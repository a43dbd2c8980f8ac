"""`retrysafe demo` stops cleanly on SIGTERM and SIGINT, whenever the signal arrives."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# A short demo with every phase: a naive pass, the outbox pass, and UNKNOWN jobs to reconcile.
_SHORT_DEMO = [
    "--jobs", "6", "--loss-rate", "1", "--timeout", "0.3", "--attempts", "2",
    "--concurrency", "3",
]  # fmt: skip
# What the demo writes on stderr before its work ends (stderr is not a terminal here).
_PHASE_LINES = (
    "retrysafe demo:",
    "starting the publishing service",
    "naive client",
    "recording",
    "retrysafe outbox worker",
    "healing the link",
    "reconciling UNKNOWN jobs",
)


def _start(tmpdir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "demo", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1", "COLUMNS": "400"},
    )


def _read_until(proc: subprocess.Popen[str], prefix: str) -> list[str]:
    """stderr lines up to and including the first that starts with ``prefix``."""
    assert proc.stderr is not None
    seen: list[str] = []
    while not seen or not seen[-1].startswith(prefix):
        line = proc.stderr.readline()
        assert line, f"the demo ended before {prefix!r}: {seen}"
        seen.append(line)
    return seen


def _processes_with_env(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``marker`` (children inherit it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def _signal_at(
    tmp_path: Path, name: str, sig: signal.Signals, after: str, delay: float
) -> tuple[int, str, str]:
    """Run the short demo with a fresh TMPDIR, send ``sig`` ``delay`` s after the stderr line
    starting with ``after``; assert it exits within 5 s leaving no file and no process.
    Returns (exit status, the rest of stderr, stdout)."""
    tmpdir = tmp_path / name
    tmpdir.mkdir()
    proc = _start(tmpdir, *_SHORT_DEMO)
    try:
        _read_until(proc, after)
        time.sleep(delay)  # the random moment itself, drawn from a seeded RNG
        proc.send_signal(sig)
        stdout, rest = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert list(tmpdir.iterdir()) == [], f"{name}: files left behind"
    assert _processes_with_env(f"TMPDIR={tmpdir}") == [], f"{name}: processes left behind"
    return proc.returncode, rest, stdout


@pytest.mark.parametrize("quarter", [0, 1, 2, 3])  # four tests, so the suite's workers share them
def test_sigterm_at_20_random_moments_exits_143_leaving_nothing(
    tmp_path: Path, quarter: int
) -> None:
    """20 runs, each sent SIGTERM at a random moment of its run (a phase line, then a random
    delay): every one exits 143 within 5 s with one clear line and no traceback, its
    temporary directory is gone and no process it started is left."""
    rng = random.Random(11)
    moments = [
        (rng.choice(_PHASE_LINES[:5] if run % 2 else _PHASE_LINES), rng.uniform(0.0, 0.1))
        for run in range(20)
    ]
    for run in range(quarter * 5, quarter * 5 + 5):
        after, delay = moments[run]
        code, rest, stdout = _signal_at(tmp_path, f"run{run}", signal.SIGTERM, after, delay)
        where = f"run {run}: SIGTERM {delay:.3f} s after {after!r}"
        assert code == 143, f"{where}: exit {code}\n{rest}"
        assert "Traceback" not in rest, where
        assert "retrysafe: error: terminated (SIGTERM)" in rest, where
        assert stdout == "", where


def test_sigint_exits_130_leaving_nothing(tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) during the outbox pass: exit 130, one line, nothing left behind."""
    code, rest, _ = _signal_at(tmp_path, "int", signal.SIGINT, "retrysafe outbox worker", 0.0)
    assert code == 130, rest
    assert "Traceback" not in rest
    assert "retrysafe: error: interrupted (SIGINT)" in rest


def test_sigterm_before_the_services_start_exits_143(tmp_path: Path) -> None:
    """SIGTERM right as the banner appears (services not yet up): exit 143, nothing left."""
    code, rest, _ = _signal_at(tmp_path, "early", signal.SIGTERM, "retrysafe demo:", 0.0)
    assert code == 143, rest
    assert "Traceback" not in rest


# A demo thread that never looks at its stop event: the supervisor must still exit in time.
_STUCK_DEMO = """
import sys, threading
from pathlib import Path

import pytest
from retrysafe.cli._demo import _supervise
from retrysafe.cli._signals import Signals

workdir = Path(sys.argv[1])
(workdir / "keys.db").write_text("in use")

def run(stop):
    print("ready", flush=True)
    stop.wait()
    print("asked to stop", flush=True)
    threading.Event().wait()

with Signals() as signals:
    _supervise(run, signals, workdir, before_forced_exit=lambda: None)
"""


def _stuck_demo(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    workdir = tmp_path / "retrysafe-demo-stuck"
    workdir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _STUCK_DEMO, str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    return proc, workdir


def test_a_demo_that_does_not_stop_is_ended_within_5_s(tmp_path: Path) -> None:
    """Should the demo's thread ignore the stop request, the process still removes the
    temporary directory and exits 143 within 5 s of SIGTERM."""
    proc, workdir = _stuck_demo(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stderr
    assert "did not stop in time" in stderr
    assert not workdir.exists()


def test_a_second_signal_ends_the_demo_at_once(tmp_path: Path) -> None:
    """A second SIGINT while the demo stops ends it without waiting for the grace: 130,
    files removed."""
    proc, workdir = _stuck_demo(tmp_path)
    assert proc.stdout is not None
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline() == "asked to stop\n"  # the first one was seen
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, stderr
    assert not workdir.exists()
