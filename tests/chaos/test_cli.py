"""``retrysafe chaos proxy``: bad input gives a clear message and a non-zero exit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from retrysafe import ConfigurationError
from retrysafe._serving import ServerThread, free_port
from retrysafe.chaos import ChaosProxy
from retrysafe.cli import cli


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["chaos", "proxy", *args])
    return result.exit_code, result.output


def test_rate_above_one_is_a_usage_error_naming_the_option() -> None:
    """--lose-after-commit 1.5 exits 2 with a message naming the option."""
    code, output = run("--upstream", "http://127.0.0.1:9", "--lose-after-commit", "1.5")
    assert code == 2
    assert "--lose-after-commit" in output


def test_negative_rate_is_a_usage_error_naming_the_option() -> None:
    """--latency -0.1 exits 2 with a message naming the option."""
    code, output = run("--upstream", "http://127.0.0.1:9", "--latency", "-0.1")
    assert code == 2
    assert "--latency" in output


def test_rates_summing_over_one_are_a_usage_error() -> None:
    """Two rates of 0.6 exit 2 and say that the rates must sum to at most 1."""
    code, output = run(
        "--upstream", "http://127.0.0.1:9", "--lose-after-commit", "0.6",
        "--error-before-forward", "0.6",
    )  # fmt: skip
    assert code == 2
    assert "sum" in output
    assert "--error-before-forward" in output


def test_bad_latency_range_is_a_usage_error() -> None:
    """--latency-ms 200-50 exits 2 naming --latency-ms."""
    code, output = run("--upstream", "http://127.0.0.1:9", "--latency-ms", "200-50")
    assert code == 2
    assert "--latency-ms" in output


@pytest.mark.parametrize(
    "upstream",
    # Not http(s); and, a fresh user's check, taken and run: a port out of range, port 0,
    # a space in the host.
    ["ftp://example.com", "http://127.0.0.1:99999", "http://127.0.0.1:0", "http://a b:80"],
)
def test_bad_upstream_is_a_usage_error(upstream: str) -> None:
    """An upstream that is not an http(s) URL a proxy could reach exits 2 naming --upstream."""
    code, output = run("--upstream", upstream, "--listen", f"127.0.0.1:{free_port()}")
    assert code == 2
    assert "--upstream" in output


def test_port_in_use_exits_1_with_one_clear_line() -> None:
    """A port already in use exits 1 with one line saying so."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output = run("--upstream", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{port}")
    assert code == 1
    assert output.strip().splitlines() == [
        f"retrysafe: error: cannot listen on 127.0.0.1:{port}: the port is already in use"
    ]


def test_proxy_runs_until_interrupted_and_prints_a_summary(tmp_path: Path) -> None:
    """With an unreachable upstream it warns, answers 502, and on Ctrl-C prints counts and
    exits 130 (stopped by SIGINT, docs/cli.md)."""
    port = free_port()
    log = tmp_path / "chaos.jsonl"
    command = [
        sys.executable, "-c", "from retrysafe.cli import main; main()",
        "chaos", "proxy", "--upstream", f"http://127.0.0.1:{free_port()}",
        "--listen", f"127.0.0.1:{port}", "--seed", "7", "--log", str(log),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the proxy did not start listening"
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/anything", timeout=5)
                break
            except httpx.ConnectError:
                time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert response.status_code == 502
    assert proc.returncode == 130
    assert "warning: cannot connect to upstream" in stderr
    assert "(seed 7)" in stderr
    assert "1 requests (seed 7)" in stdout
    assert "upstream errors (502)  1" in stdout
    assert json.loads(log.read_text())["outcome"] == "bad_gateway"


def test_log_in_a_missing_directory_is_a_usage_error_and_creates_nothing(tmp_path: Path) -> None:
    """--log under a directory that does not exist exits 2 naming --log; no directory appears."""
    log = tmp_path / "no" / "such" / "chaos.jsonl"
    code, output = run(
        "--upstream", "http://127.0.0.1:9", "--listen", f"127.0.0.1:{free_port()}",
        "--log", str(log),
    )  # fmt: skip
    assert code == 2
    assert "--log" in output
    assert "does not exist" in output
    assert not (tmp_path / "no").exists()


def _proxy_process(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "retrysafe", "chaos", "proxy", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _wait_ready(proc: subprocess.Popen[str]) -> None:
    """Until the proxy says it listens (the line after its fault rates)."""
    assert proc.stderr is not None
    while not (line := proc.stderr.readline()).startswith("press Ctrl-C"):
        assert line, "the proxy exited before listening"


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A tiny upstream: 200 ok."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _dropped(sock: socket.socket) -> bool:
    """True when the peer closed or reset ``sock`` without sending anything."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def test_sigterm_with_a_held_answer_exits_143_within_5_s_with_a_json_summary() -> None:
    """SIGTERM while the proxy holds an answer for 60 s: it drops the connection, prints its
    summary as one JSON object on stdout (--json) and exits 143 within 5 s."""
    port = free_port()
    with ServerThread(_ok) as upstream:
        proc = _proxy_process(
            "--upstream", upstream.url, "--listen", f"127.0.0.1:{port}", "--seed", "3",
            "--hold-after-commit", "1", "--hold-seconds", "60", "--json",
        )  # fmt: skip
        try:
            _wait_ready(proc)
            held = socket.create_connection(("127.0.0.1", port))
            held.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            # The proxy holds the answer once the upstream has it: poll the upstream's count.
            deadline = time.monotonic() + 20
            while not upstream.server.server_state.total_requests:
                assert time.monotonic() < deadline, "the request never reached the upstream"
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=5)
            assert _dropped(held)  # not answered
            held.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 143, stderr
    assert "Traceback" not in stderr
    doc = json.loads(stdout)
    assert doc["seed"] == 3
    assert doc["requests"] == 1
    assert doc["faults"]["hold_after_commit"] == 1
    assert doc["stopped_by"] == "SIGTERM"


def _never_started(self: ChaosProxy, **kwargs: object) -> ChaosProxy:
    raise AssertionError("the proxy started")


@pytest.mark.parametrize(
    ("upstream", "listen"),
    [
        ("http://127.0.0.1:{port}", "127.0.0.1:{port}"),
        ("http://localhost:{port}", "127.0.0.1:{port}"),
        ("http://127.0.0.1:{port}/api", "localhost:{port}"),
        ("http://0.0.0.0:{port}", "127.0.0.1:{port}"),
        ("http://127.0.0.1:{port}", "0.0.0.0:{port}"),
    ],
)
def test_own_listen_address_as_upstream_is_refused(
    monkeypatch: pytest.MonkeyPatch, upstream: str, listen: str
) -> None:
    """An upstream that resolves to the proxy's own listen address (127.0.0.1 or localhost,
    any path) would forward every request to itself: exit 2, one line naming --upstream, and
    the proxy never starts."""
    monkeypatch.setattr(ChaosProxy, "start_in_thread", _never_started)
    port = free_port()
    code, output = run(
        "--upstream", upstream.format(port=port), "--listen", listen.format(port=port)
    )
    assert code == 2, output
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert lines[0].startswith("retrysafe: error: --upstream:")
    assert "own --listen address" in lines[0]


def test_library_refuses_its_own_address_once_port_0_is_bound() -> None:
    """Port 0 cannot collide before binding; once bound, a proxy whose upstream is that very
    port is refused (option "upstream") and stops listening."""
    port = free_port()
    proxy = ChaosProxy(f"http://localhost:{port}", port=port)
    with pytest.raises(ConfigurationError) as caught:
        proxy.start_in_thread()
    assert caught.value.option == "upstream"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))
    with ServerThread(_ok) as upstream, ChaosProxy(upstream.url, port=0) as ok:
        assert httpx.get(ok.url + "/x").text == "ok"


BIG_DIGITS = "9" * (10 * 1024 * 1024)
BIG_TEXT = "x" * (10 * 1024 * 1024)
BAD = {"empty": "", "nan": "nan", "inf": "inf", "negative": "-1", "10MB-digits": BIG_DIGITS,
       "10MB-text": BIG_TEXT}  # fmt: skip
# Values that are fine for an option: "nan" is a valid file name for --log.
VALID = {("--log", "nan"), ("--log", "inf"), ("--log", "-1")}
OPTIONS = ["--upstream", "--listen", "--seed", "--lose-after-commit", "--hold-after-commit",
           "--error-after-commit", "--reset-before-forward", "--error-before-forward",
           "--latency", "--hold-seconds", "--latency-ms", "--upstream-timeout",
           "--log"]  # fmt: skip


@pytest.mark.parametrize(
    ("option", "value"),
    [
        pytest.param(option, value, id=f"{option}-{name}")
        for option in OPTIONS
        for name, value in BAD.items()
        if (option, value) not in VALID
    ],
)
def test_bad_value_exits_2_with_one_line_naming_the_option(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, option: str, value: str
) -> None:
    """Empty, NaN, infinite, negative and 10 MB values: exit 2, one line of at most 1000
    characters naming the option; the proxy never starts."""

    monkeypatch.setattr(ChaosProxy, "start_in_thread", _never_started)
    monkeypatch.chdir(tmp_path)
    args = {"--upstream": "http://127.0.0.1:9", "--listen": f"127.0.0.1:{free_port()}"}
    args[option] = value
    result = CliRunner().invoke(cli, ["chaos", "proxy", *[x for kv in args.items() for x in kv]])
    assert result.exit_code == 2, (result.exception, result.stderr[-300:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[:2000]
    assert lines[0].startswith(f"retrysafe: error: {option}")
    assert len(lines[0]) <= 1000
    assert list(tmp_path.iterdir()) == []
