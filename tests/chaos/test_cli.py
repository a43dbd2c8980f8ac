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

import httpx
from click.testing import CliRunner

from retrysafe._serving import free_port
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


def test_bad_upstream_is_a_usage_error() -> None:
    """An upstream that is not an http(s) URL exits 2 naming --upstream."""
    code, output = run("--upstream", "ftp://example.com", "--listen", f"127.0.0.1:{free_port()}")
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
    """With an unreachable upstream it warns, answers 502, and on Ctrl-C prints counts, exit 0."""
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
    assert proc.returncode == 0
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
