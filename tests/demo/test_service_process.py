"""The demo's service runs in a process of its own (retrysafe._serving.ServerProcess), and
retrysafe's own processes tune the garbage collector for long-running work."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from retrysafe._gc import SERVING_THRESHOLD
from retrysafe._serving import ServerProcess, stop_processes
from retrysafe.chaos import EffectLedger
from retrysafe.demo import DemoOptions, run_demo


def _service(tmp_path: Path, *extra: str) -> ServerProcess:
    return ServerProcess(
        "retrysafe.demo._child",
        [
            *("--keys", str(tmp_path / "keys.db"), "--ledger", str(tmp_path / "effects.jsonl")),
            *("--lease", "30", "--max-body-size", "1024"),
            *extra,
        ],
        log=tmp_path / "service.log",
    )


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def test_the_service_process_publishes_into_the_shared_ledger(tmp_path: Path) -> None:
    """A post through the child process is counted in the ledger file this process reads, once
    per key; the child is gone after stop()."""
    with _service(tmp_path) as service:
        assert service.proc is not None and service.proc.pid != os.getpid()
        for _ in range(2):
            answer = httpx.post(
                service.url + "/posts",
                json={"operation": "op-1"},
                headers={"Idempotency-Key": "k-1"},
                timeout=10,
            )
            assert answer.status_code == 201
        pid = service.proc.pid
    assert EffectLedger(tmp_path / "effects.jsonl").counts() == {"op-1": 1}
    assert _gone(pid, 0.1)


def _proxy_children(parent: int) -> list[int]:
    """The pids of ``parent``'s children that run the demo's proxy."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == parent and b"retrysafe.demo._proxy_child" in cmdline:
            pids.append(int(entry.name))
    return pids


def _orphan(tmp_path: Path, workdir: Path, *extra: str) -> None:
    """Start the service from a parent process, SIGKILL the parent, wait for the child."""
    code = (
        "import sys, time; from pathlib import Path; "
        "sys.path.insert(0, sys.argv[2]); "
        "from test_service_process import _service; "
        "s = _service(Path(sys.argv[1]), *sys.argv[3:]).start(); "
        "print(s.proc.pid, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(workdir), str(Path(__file__).parent), *extra],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _gone(child, 5), "the service outlived its parent"


def test_an_orphaned_service_exits_and_removes_the_demos_temporary_directory(
    tmp_path: Path,
) -> None:
    """A parent SIGKILLed outright cannot stop its child: the child notices and exits, and
    removes the demo's temporary directory, whose cleanup never ran. Without the option (a
    caller's own directory) nothing is removed."""
    own = tmp_path / "retrysafe-demo-abc"
    own.mkdir()
    _orphan(tmp_path, own, "--remove-when-orphaned", str(own))
    assert not own.exists()

    other = tmp_path / "my-data"
    other.mkdir()
    _orphan(tmp_path, other)
    assert (other / "keys.db").exists()


def test_a_stopped_service_leaves_the_directory_to_the_demo(tmp_path: Path) -> None:
    """Stopped normally (the demo's own cleanup runs), the service removes nothing."""
    own = tmp_path / "retrysafe-demo-abc"
    own.mkdir()
    with _service(own, "--remove-when-orphaned", str(own)):
        pass
    assert (own / "keys.db").exists()


def test_a_demo_killed_outright_leaves_no_temporary_directory(tmp_path: Path) -> None:
    """`retrysafe demo` SIGKILLed mid-run (the OOM killer, `kill -9`): within seconds its
    temporary directory is gone, and so are its service and its proxy (which sees the end of
    its control pipe)."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    demo = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "demo", "--jobs", "100000", "--no-naive"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert demo.stderr is not None
        for line in demo.stderr:  # the service answers before the outbox is filled
            if "recording" in line:
                break
        dirs = list(tmp_path.glob("retrysafe-demo-*"))
        assert len(dirs) == 1 and (dirs[0] / "service.log").exists()
        proxies = _proxy_children(demo.pid)
        assert len(proxies) == 1
    finally:
        demo.send_signal(signal.SIGKILL)
        demo.wait()
    deadline = time.monotonic() + 5
    while dirs[0].exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not dirs[0].exists(), "the killed demo's temporary directory was left behind"
    assert _gone(proxies[0], 5), "the killed demo's proxy was left running"


def test_a_service_that_cannot_start_names_its_last_output(tmp_path: Path) -> None:
    """A child that exits before serving (here: its key store's directory is missing) is a
    ConfigurationError that quotes the child's last line, and nothing is left running."""
    from retrysafe import ConfigurationError

    service = ServerProcess(
        "retrysafe.demo._child",
        [
            *("--keys", str(tmp_path / "no" / "keys.db"), "--ledger", str(tmp_path / "e.jsonl")),
            *("--lease", "30", "--max-body-size", "1024"),
        ],
        log=tmp_path / "service.log",
    )
    with pytest.raises(ConfigurationError, match=r"exited with status \d+ before it served: "):
        service.start()
    assert service.proc is not None and service.proc.poll() is not None


def test_stop_processes_kills_every_live_service_at_once(tmp_path: Path) -> None:
    """The forced exit's clean-up: every live service process is killed and waited for."""
    service = _service(tmp_path).start()
    assert service.proc is not None
    stop_processes()
    assert service.proc.poll() is not None


def test_the_demo_counts_the_posts_of_its_service_process() -> None:
    """run_demo's effects are the child's: every protected job published exactly once."""
    result = run_demo(DemoOptions(jobs=20, loss_rate=0.2, seed=2, concurrency=4, timeout=1.0))
    report = result.protected.report
    assert (report.effects, report.duplicates, report.lost) == (20, 0, 0)


def test_the_command_tunes_the_collector_but_the_library_does_not() -> None:
    """`retrysafe` as a program sets the serving thresholds; calling its main() with
    arguments from a process of the application's leaves that process's collector alone."""
    before = gc.get_threshold()
    from retrysafe.cli import main

    with pytest.raises(SystemExit):
        main(["--version"])
    assert gc.get_threshold() == before
    code = (
        "import gc, sys; from retrysafe.cli import main; sys.argv = ['retrysafe', '--version']\n"
        "try:\n    main()\nexcept SystemExit:\n    print(gc.get_threshold())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == str(SERVING_THRESHOLD)


def _pids_with_arg(arg: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if arg.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_service_that_dies_mid_run_ends_the_demo_at_once(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """The service process killed during the naive pass: the demo fails within seconds,
    naming the signal, instead of sending every request into a socket nobody serves."""
    from retrysafe import RetrysafeError
    from retrysafe.demo import Progress

    class KillOnStart(Progress):
        def start(self, phase: str, total: int) -> None:
            for pid in _pids_with_arg(str(tmp_path / "keys.db")):
                os.kill(pid, sig)

    options = DemoOptions(jobs=2000, loss_rate=0.0, concurrency=8, timeout=5.0)
    started = time.monotonic()
    with pytest.raises(RetrysafeError, match=rf"service exited \(signal {int(sig)}\)"):
        run_demo(options, KillOnStart(), workdir=tmp_path)
    assert time.monotonic() - started < 10
    assert _pids_with_arg(str(tmp_path / "keys.db")) == []
