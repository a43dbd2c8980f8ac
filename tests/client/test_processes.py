"""`retrysafe worker --processes N`: N forked worker processes from one command, which run,
take signals and stop together (src/retrysafe/cli/_processes.py, docs/cli.md)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from click.testing import CliRunner

from retrysafe import JobState, Outbox
from retrysafe.cli import cli
from retrysafe.cli._client import Served
from retrysafe.client import WorkerStats

from .conftest import Script, Step

T = TypeVar("T")

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="--processes needs fork")


def _worker(store: str, *args: str, session: bool = False) -> subprocess.Popen[str]:
    """``retrysafe worker`` in a child process (``session``: leading a process group of its
    own, as a shell's foreground job does)."""
    return subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "worker", "--store", store, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=None if session else lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
        start_new_session=session,
    )


def _children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux's /proc)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _ignores(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` ignores ``sig`` (its SigIgn mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(
        next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn")), 16
    )
    return bool(mask >> (sig - 1) & 1)


def _wait_for(what: str, ok: object, timeout: float = 30.0, step: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not ok() if callable(ok) else not ok:
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(step)


def _once_sent(
    proc: subprocess.Popen[str], script: Script, path: str, count: int, act: Callable[[], T]
) -> tuple[T, str, str]:
    """Once the endpoint has ``count`` requests on ``path``: ``act()`` (the signals), then
    what it returned and the command's stdout and stderr; a command still running after
    that is killed (no test leaves one behind)."""
    try:
        _wait_for(f"{count} requests", lambda: len(script.requests(path)) == count)
        acted = act()
        out, err = proc.communicate(timeout=30)
        return acted, out, err
    finally:
        if proc.poll() is None:
            proc.kill()


def _submit(store: str, url: str, n: int) -> list[str]:
    with Outbox(store) as outbox:
        return [outbox.submit(url, json={"n": i}).id for i in range(n)]


@contextlib.contextmanager
def _on_a_terminal(
    *args: str,
) -> Iterator[tuple[subprocess.Popen[bytes], int, bytearray]]:
    """``retrysafe worker ARGS`` with a pseudo-terminal as its stdout and stderr: the
    process, the terminal's fd (for ``tcflow``) and what it has shown so far. The command is
    killed if it is still running at the end."""
    import pty
    import threading

    master, terminal = pty.openpty()
    seen_out = bytearray()

    def drain() -> None:
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 65536):
                seen_out.extend(chunk)

    proc = subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "worker", *args],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
    )
    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        _wait_for("the status line", lambda: b"retrysafe worker" in seen_out, timeout=30)
        yield proc, terminal, seen_out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(terminal)
        reader.join(5)
        os.close(master)


def test_the_processes_share_the_queue_and_one_summary_counts_them_all(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """Three processes at -c 1 against an endpoint that takes 1.5 s: the three jobs are in
    flight together (one process would send them one after another, 1.5 s apart), each is
    sent once, and the one summary line counts all three."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/slow", Step(201, sleep=1.5))
    ids = _submit(store, base_url + "/slow", 3)
    proc = _worker(store, "--processes", "3", "-c", "1", "--until-idle", "--json")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    seen = script.requests("/slow")
    assert len({s.key for s in seen}) == len(seen) == 3 and None not in {s.key for s in seen}
    assert max(s.at for s in seen) - min(s.at for s in seen) < 1.5
    summaries = [json.loads(line) for line in out.splitlines() if '"stopped"' in line]
    assert len(summaries) == 1 and summaries[0]["succeeded"] == 3, out
    assert summaries[0]["claimed"] == 3 and summaries[0]["attempts"] == 3
    attempts = [json.loads(line) for line in out.splitlines() if '"attempt"' in line]
    assert len(attempts) == 3  # every child's lines, whole
    with Outbox(store) as outbox:
        assert {outbox.get(i).state for i in ids} == {JobState.SUCCEEDED}


@pytest.mark.parametrize(
    ("sigs", "code", "state", "says", "group"),
    [
        ([signal.SIGTERM], 143, JobState.SUCCEEDED, "retrysafe: stopped by SIGTERM", False),
        ([signal.SIGINT], 130, JobState.PENDING, "retrysafe: interrupted: in-flight jobs", False),
        ([signal.SIGINT], 130, JobState.PENDING, "retrysafe: interrupted: in-flight jobs", True),
        (
            [signal.SIGTERM, signal.SIGINT],
            130,
            JobState.PENDING,
            "retrysafe: interrupted: in-flight jobs",
            False,
        ),
    ],
    ids=["term", "int", "int-to-the-group", "term-then-int"],
)
def test_a_signal_to_the_command_reaches_every_process_once(
    sqlite_path: Path,
    script: Script,
    base_url: str,
    sigs: list[signal.Signals],
    code: int,
    state: JobState,
    says: str,
    group: bool,
) -> None:
    """SIGTERM to the command: every process's attempt finishes and is recorded (exit 143);
    Ctrl-C once: every process gives its job back, pending with its key (exit 130) -- also
    when it is sent to the command's whole process group, as a terminal's Ctrl-C is (the
    processes ignore SIGINT and take the command's one); SIGTERM then Ctrl-C: released, 130,
    as for one worker. Either way one summary and one closing line."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/slow", Step(201, sleep=2.0))
    ids = _submit(store, base_url + "/slow", 2)
    proc = _worker(store, "--processes", "2", "-c", "1", "--json", session=group)

    def send() -> None:
        if group:
            assert all(_ignores(c, signal.SIGINT) for c in _children(proc.pid))
        for sig in sigs:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
            time.sleep(0.2)

    _, out, err = _once_sent(proc, script, "/slow", 2, send)
    assert proc.returncode == code, err
    assert err.count(says) == 1 and "again" not in err, err
    summaries = [json.loads(line) for line in out.splitlines() if '"stopped"' in line]
    assert len(summaries) == 1, out
    with Outbox(store) as outbox:
        assert {outbox.get(i).state for i in ids} == {state}
    assert len(script.requests("/slow")) == 2


def test_ctrl_c_pressed_again_and_again_is_said_once_and_still_exits_130(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """Ctrl-C hammered (six presses 15 ms apart): the second press's line is said once, by
    the command, not once per process; the presses after the stop are ignored, so the
    command exits 130 (it died by SIGINT); no traceback."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/slow", Step(201, sleep=2.0))
    _submit(store, base_url + "/slow", 3)
    proc = _worker(store, "--processes", "3", "-c", "1", "--json")

    def hammer() -> None:
        for _ in range(6):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.015)

    _, _, err = _once_sent(proc, script, "/slow", 3, hammer)
    assert proc.returncode == 130, err
    assert err.count("interrupt again to exit at once") <= 1 and "Traceback" not in err, err


def test_a_stopped_process_cannot_hold_the_command(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """One process stopped (SIGSTOP) takes no signal: after a third Ctrl-C the command
    kills it one second later and exits 130, saying so, instead of waiting for ever."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/slow", Step(201, sleep=3.0))
    _submit(store, base_url + "/slow", 2)
    proc = _worker(store, "--processes", "2", "-c", "1", "--json")

    def stop_one_then_interrupt() -> int:
        stopped = _children(proc.pid)[0]
        os.kill(stopped, signal.SIGSTOP)
        for _ in range(3):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.1)
        return stopped

    stopped, _, err = _once_sent(proc, script, "/slow", 2, stop_one_then_interrupt)
    assert proc.returncode == 130, err
    assert f"still running after the stop's limit ({stopped}): killed" in err, err
    # Not "released": the killed process's job waits out its lease.
    assert "in-flight jobs not yet released wait out their lease" in err, err


def test_a_killed_process_stops_the_others_and_the_command_says_which(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """One child killed (SIGKILL): the other is stopped as by SIGTERM (its attempt finishes),
    and the command exits 137 with a line naming the killed process."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/slow", Step(201, sleep=1.5))
    _submit(store, base_url + "/slow", 2)
    proc = _worker(store, "--processes", "2", "-c", "1", "--json")

    def kill_one() -> int:
        victim = _children(proc.pid)[0]
        os.kill(victim, signal.SIGKILL)
        return victim

    victim, out, err = _once_sent(proc, script, "/slow", 2, kill_one)
    assert proc.returncode == 137, err
    assert f"retrysafe: error: worker process {victim} was killed (SIGKILL)" in err
    assert len(script.requests("/slow")) == 2
    summaries = [json.loads(line) for line in out.splitlines() if '"stopped"' in line]
    assert len(summaries) == 1 and summaries[0]["succeeded"] == 1, out  # the other's


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_processes_stop_when_the_command_is_killed(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """The command itself killed (SIGKILL, no chance to forward anything): each child gets
    SIGTERM from the kernel, finishes its attempt and exits; none keeps running alone."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/slow", Step(201, sleep=1.0))
    ids = _submit(store, base_url + "/slow", 2)
    proc = _worker(store, "--processes", "2", "-c", "1", "--json")
    try:
        _wait_for("both requests", lambda: len(script.requests("/slow")) == 2)
        children = _children(proc.pid)
        assert len(children) == 2
        proc.kill()
        _, err = proc.communicate(timeout=30)  # the children hold stderr until they exit
        _wait_for("the children to exit", lambda: not any(_alive(c) for c in children))
        assert "Traceback" not in err, err  # a result nobody reads is not an error
    finally:
        if proc.poll() is None:
            proc.kill()
    with Outbox(store) as outbox:
        assert {outbox.get(i).state for i in ids} == {JobState.SUCCEEDED}
    assert len(script.requests("/slow")) == 2


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, reaped by init soon, counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_store_that_cannot_be_used_is_reported_once(tmp_path: Path) -> None:
    """A store the processes cannot use is found before any is forked: one error line, not
    one per process, and the exit code of one worker."""
    store = f"sqlite:///{tmp_path / 'missing' / 'o.db'}"
    proc = _worker(store, "--processes", "4", "--until-idle")
    _, err = proc.communicate(timeout=30)
    one = _worker(store, "--until-idle")
    _, one_err = one.communicate(timeout=30)
    assert proc.returncode == one.returncode != 0
    assert err == one_err and err.count("retrysafe: error:") == 1, err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--processes", "0"), "--processes: 0 is not in the range"),
        (("--processes", "257"), "--processes: 257 is not in the range"),
        (("--processes", "two"), "--processes: 'two' is not a valid integer"),
        (("--processes", "2", "--metrics", "127.0.0.1:9464"), "--metrics serves one process"),
    ],
)
def test_bad_process_counts_are_usage_errors(
    sqlite_path: Path, args: tuple[str, ...], says: str
) -> None:
    """Exit 2 with one line, nothing opened or forked."""
    store = f"sqlite:///{sqlite_path}"
    result = CliRunner().invoke(cli, ["worker", "--store", store, *args])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"retrysafe: error: {says}"), result.stderr
    assert not sqlite_path.exists()


def test_the_children_results_merge_into_one() -> None:
    """Counters sum (the outcomes by name too); SIGINT wins over SIGTERM over none."""
    a = Served(WorkerStats(succeeded=2, attempts=3, outcomes={"2xx": 2, "timeout": 1}), None)
    b = Served(WorkerStats(succeeded=1, attempts=1, outcomes={"2xx": 1}), 143, forced=True)
    c = Served(WorkerStats(unknown=1), 130)
    merged = Served.merged([Served.from_dict(json.loads(json.dumps(s.to_dict()))) for s in (a, b)])
    assert merged.stats.succeeded == 3 and merged.stats.attempts == 4
    assert merged.stats.outcomes == {"2xx": 3, "timeout": 1}
    assert merged.code == 143 and merged.forced
    assert Served.merged([a, b, c]).code == 130
    assert Served.merged([a]).code is None and not Served.merged([a]).forced


@pytest.mark.parametrize("processes", [1, 3])
@pytest.mark.parametrize(
    ("redirect", "code"),
    [(">&-", 0), ("| head -1 >/dev/null", 0), (">/dev/full", 1)],
    ids=["closed", "reader-leaves", "full"],
)
def test_a_stdout_that_cannot_take_the_lines_loses_no_job(
    sqlite_path: Path, script: Script, base_url: str, processes: int, redirect: str, code: int
) -> None:
    """The worker's JSON lines on a closed stdout are dropped and its jobs all delivered;
    when the reader leaves (`| head -1`) the rest is dropped and the work goes on (exit 0);
    on a stdout that fails (`>/dev/full`) the worker stops as on SIGTERM and exits 1 with
    one line. Never a traceback, and never a job left in flight: the attempt's log line
    raised inside the worker, killing its task (the job in flight until its lease ended and
    the command hung; a fresh user's check)."""
    if redirect.endswith("/dev/full") and not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    store = f"sqlite:///{sqlite_path}"
    ids = _submit(store, base_url + "/ok", 40)
    command = (
        f"{sys.executable} -m retrysafe worker --store {store} --until-idle --json "
        f"--processes {processes} -c 2 {redirect}"
    )
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr and "never retrieved" not in done.stderr, done.stderr
    with Outbox(store) as outbox:
        states = {outbox.get(i).state for i in ids}
    if code == 0:
        assert states == {JobState.SUCCEEDED}
        assert done.stderr == ""
    else:
        assert states <= {JobState.SUCCEEDED, JobState.PENDING}, states
        [line] = done.stderr.splitlines()  # one line, not one per process
        assert line.startswith("retrysafe: error: cannot write to stdout: No space left")
    seen = script.requests("/ok")
    assert len({s.key for s in seen}) == len(seen)  # each job sent once


def test_ctrl_c_as_the_processes_start_is_said_once(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """Ctrl-C the moment the processes exist (before their event loops take it): each stops
    as one worker does before its loop runs, and the command alone says so -- not one
    `retrysafe: interrupted` per process; exit 130, nothing sent."""
    store = f"sqlite:///{sqlite_path}"
    _submit(store, base_url + "/ok", 4)
    proc = _worker(store, "--processes", "3", "-c", "1", "--json")
    try:
        _wait_for("three processes", lambda: len(_children(proc.pid)) == 3, step=0.001)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    lines = err.splitlines()
    assert "retrysafe: interrupted" not in lines and len(lines) == 1, err


@pytest.mark.parametrize("processes", [1, 2])
def test_a_reader_that_falls_behind_holds_up_no_attempt_and_no_stop(
    sqlite_path: Path, script: Script, base_url: str, processes: int
) -> None:
    """stdout a pipe nobody reads (a stalled log shipper, `| less`): the worker's event loop
    wrote its lines itself and blocked once the pipe was full -- answers that had arrived
    went unread until their attempts timed out and leases went unrenewed, so jobs answered
    200 were sent again (a fresh user's check), and SIGTERM was not acted on. Now every job
    is delivered once while the reader is still away, SIGTERM ends the command within its
    limits (the lines it could not write in time are dropped), and what was written is
    whole JSON lines."""
    store = f"sqlite:///{sqlite_path}"
    ids = _submit(store, base_url + "/ok", 400)  # ~170 KB of attempt lines: 2.5 pipes' worth
    proc = _worker(store, "--processes", str(processes), "-c", "8", "--json")
    try:

        def delivered() -> bool:
            with Outbox(store) as outbox:
                return all(outbox.get(i).state is JobState.SUCCEEDED for i in ids)

        _wait_for("every job delivered, stdout unread", delivered, timeout=60, step=0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 143  # stdout still unread
        out = proc.stdout.read() if proc.stdout is not None else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    seen = script.requests("/ok")
    assert len(seen) == len({s.key for s in seen}) == 400  # each job sent once
    assert all(json.loads(line) for line in out.splitlines())


def test_a_terminal_that_stops_taking_output_holds_up_no_attempt(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """The worker on a terminal whose output is stopped (Ctrl-S): its status line was
    updated from the event loop, which then waited for the terminal while rich's thread
    held the line's lock blocked in ``write`` -- every attempt stood still, answers unread,
    leases unrenewed. Now the line is drawn by rich's thread alone and warnings are written
    by a thread of their own: every job is delivered, once, while the terminal is stopped,
    and once it takes output again SIGTERM ends the command as usual."""
    import termios

    store = f"sqlite:///{sqlite_path}"
    _submit(store, base_url + "/ok", 0)  # the schema
    with _on_a_terminal("--store", store, "-c", "8") as (proc, terminal, seen_out):
        termios.tcflow(terminal, termios.TCOOFF)  # Ctrl-S: every write to it now waits
        ids = _submit(store, base_url + "/ok", 200)

        def delivered() -> bool:
            with Outbox(store) as outbox:
                return all(outbox.get(i).state is JobState.SUCCEEDED for i in ids)

        _wait_for("every job delivered, the terminal stopped", delivered, 30, step=0.2)
        termios.tcflow(terminal, termios.TCOON)  # Ctrl-Q
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 143
    seen = script.requests("/ok")
    assert len(seen) == len({s.key for s in seen}) == 200  # each job sent once
    assert b"stopped by SIGTERM" in seen_out


def test_a_terminal_shows_the_store_outage_in_two_lines_not_the_drivers_own(
    pg_url: str, pg_schema: str
) -> None:
    """A worker on a terminal while its PostgreSQL server was away printed psycopg's pool
    lines over its counts (one per reconnection attempt: "error connecting in
    'retrysafe-async': …", four lines each, and "discarding broken connection"), more of them
    now that a pool slot tries again every few seconds. On a terminal the worker's own two
    warnings say it: the store went away, and when it was back."""
    from _relay import PgRelay
    from retrysafe.stores import PostgresStore

    relay = PgRelay(pg_url)
    store = relay.url(pg_url)
    with PostgresStore(store, schema=pg_schema) as keys, Outbox(keys):
        pass  # the schema
    try:
        with _on_a_terminal("--store", store, "--schema", pg_schema) as (proc, _, seen_out):
            relay.down()
            _wait_for("the outage said", lambda: b"store unavailable" in seen_out, timeout=30)
            time.sleep(2)  # reconnection attempts meanwhile
            relay.refuse.clear()
            _wait_for("the store said back", lambda: b"available again" in seen_out, 30)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 143
    finally:
        relay.close()
    shown = seen_out.decode(errors="replace")
    assert "error connecting" not in shown and "discarding" not in shown, shown[-2000:]
    assert "connection failed" not in shown, shown[-2000:]


def test_sigterm_says_which_jobs_were_not_given_back(capsys: pytest.CaptureFixture[str]) -> None:
    """After SIGTERM the last line said every in-flight job was finished or released, also
    when the store could not take some back (locked) or a process was killed at the stop's
    limit: those wait out their lease (a fresh user's check; Ctrl-C's line said so)."""
    from retrysafe.cli._client import finish

    with pytest.raises(SystemExit) as stopped:
        finish(Served(WorkerStats(unreleased=16), 143, forced=True), until_idle=False, what="jobs")
    assert stopped.value.code == 143
    err = capsys.readouterr().err
    assert "except 16 the store could not take back" in err
    assert "those of a worker process killed at the stop's limit were not" in err
    with pytest.raises(SystemExit):
        finish(Served(WorkerStats(), 143), until_idle=False, what="jobs")
    assert "except" not in capsys.readouterr().err
