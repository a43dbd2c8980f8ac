"""``--metrics HOST:PORT`` on the long-running commands: a real scrape over HTTP of a running
gateway, outbox worker and webhook worker, and the bad addresses they refuse."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from retrysafe import Outbox
from retrysafe._serving import ServerThread, free_port


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "retrysafe", *args]


def _start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _cli(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def scrape(port: int, proc: subprocess.Popen[str], timeout: float = 20.0) -> dict[Any, float]:
    """``{(name, sorted labels): value}`` of one scrape, once the endpoint answers."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the command exited: {proc.communicate()[1]}")
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    out: dict[Any, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape_until(port: int, proc: subprocess.Popen[str], want: Any, timeout: float = 20.0) -> Any:
    """Scrape until ``want(samples)`` is true; the last samples."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(port, proc)
        if want(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics never matched; last scrape: {samples}")
        time.sleep(0.05)


def get(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _jobs(samples: dict[Any, float], store: str, state: str) -> float:
    """``retrysafe_outbox_jobs`` of the default queue in ``state``."""
    return get(samples, "retrysafe_outbox_jobs", store=store, queue="default", state=state)


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A real endpoint: 503 on the first request of each key, 201 after; /charge: 201."""
    seen: dict[str, int] = {}

    async def handler(request: Request) -> Response:
        key = request.headers.get("idempotency-key", "")
        seen[key] = seen.get(key, 0) + 1
        if request.url.path != "/charge" and seen[key] == 1:
            return Response(status_code=503)
        return JSONResponse({"n": seen[key]}, 201)

    app = Starlette(routes=[Route("/{p:path}", handler, methods=["POST"])])
    with ServerThread(app) as server:
        yield server.url


def test_worker_metrics_move_as_jobs_are_delivered(tmp_path: Path, endpoint: str) -> None:
    """`retrysafe worker --metrics`: a scrape shows the attempts (a 5xx then a 2xx), the jobs
    by state read from the store, and the store up."""
    db = f"sqlite:///{tmp_path}/o.db"
    with Outbox(db) as outbox:
        for i in range(3):
            outbox.submit(endpoint + f"/job{i}", json={"i": i})
    port = free_port()
    proc = _start("worker", "--store", db, "--metrics", f"127.0.0.1:{port}", "--wait-initial",
                  "0.01", "--wait-max", "0.02")  # fmt: skip
    try:
        # The jobs gauge is read from the store, the attempts are counted after the record
        # lands: a scrape between the two saw 3 succeeded jobs and 2 successes (a CI run).
        a = "retrysafe_outbox_attempts_total"
        samples = scrape_until(
            port,
            proc,
            lambda s: _jobs(s, "sqlite", "succeeded") == 3
            and get(s, a, queue="default", outcome="success", status_class="2xx") == 3,
        )
    finally:
        code, err = _stop(proc)
    assert code == 143, err
    assert get(samples, a, queue="default", outcome="server_error", status_class="5xx") == 3
    assert get(samples, a, queue="default", outcome="success", status_class="2xx") == 3
    assert get(samples, "retrysafe_store_up", store="sqlite") == 1.0
    assert (
        get(samples, "retrysafe_outbox_jobs", store="sqlite", queue="default", state="pending") == 0
    )
    assert ("process_cpu_seconds_total", ()) in samples  # the process collector is there too


def test_gateway_metrics_count_a_replay(tmp_path: Path, endpoint: str) -> None:
    """`retrysafe gateway --metrics`: a first request is ``new``, its retry ``replayed``."""
    listen, mport = free_port(), free_port()
    proc = _start(
        "gateway", "--upstream", endpoint, "--listen", f"127.0.0.1:{listen}",
        "--store", f"sqlite:///{tmp_path}/k.db", "--metrics", f"127.0.0.1:{mport}",
    )  # fmt: skip
    try:
        scrape(mport, proc)  # up
        url = f"http://127.0.0.1:{listen}/charge"
        deadline = time.monotonic() + 20
        while True:
            try:
                first = httpx.post(url, json={}, headers={"Idempotency-Key": "g1"})
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        again = httpx.post(url, json={}, headers={"Idempotency-Key": "g1"})
        samples = scrape_until(
            mport, proc,
            lambda s: get(s, "retrysafe_server_decisions_total", decision="replayed") == 1,
        )  # fmt: skip
    finally:
        code, err = _stop(proc)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["idempotent-replayed"] == "true"
    assert get(samples, "retrysafe_server_decisions_total", decision="new") == 1
    assert get(samples, "retrysafe_store_operation_duration_seconds_count",
               store="sqlite", operation="claim") == 2  # fmt: skip
    assert code == 143, err


@pytest.fixture
def pg_database(pg_url: str) -> Iterator[str]:
    """The URL of a fresh PostgreSQL database (a command line names a database, not a
    schema), dropped after the test."""
    import uuid

    import psycopg

    name = f"rs_metrics_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}".encode())
    yield pg_url.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)".encode())


def test_two_workers_on_one_postgresql_outbox_report_the_same_job_gauges(
    pg_database: str,
) -> None:
    """Two worker processes on one PostgreSQL outbox: each scrape reads the job-state gauges
    from the store, so both report the same counts (4 jobs not yet due)."""
    import psycopg

    with Outbox(pg_database) as outbox:
        for i in range(4):
            outbox.submit("http://127.0.0.1:9/x", json={"i": i})
    with psycopg.connect(pg_database, autocommit=True) as conn:  # due in an hour
        conn.execute("UPDATE outbox_jobs SET due_at = due_at + 3600")
    ports = [free_port(), free_port()]
    procs = [_start("worker", "--store", pg_database, "--metrics", f"127.0.0.1:{p}")
             for p in ports]  # fmt: skip
    try:
        scrapes = [
            scrape_until(port, proc, lambda s: _jobs(s, "postgresql", "pending") == 4)
            for port, proc in zip(ports, procs, strict=True)
        ]
    finally:
        results = [_stop(p) for p in procs]
    for state in ("pending", "in_flight", "succeeded", "unknown"):
        counts = {
            get(s, "retrysafe_outbox_jobs", store="postgresql", queue="default", state=state)
            for s in scrapes
        }
        assert len(counts) == 1, (state, counts)
    assert [get(s, "retrysafe_store_up", store="postgresql") for s in scrapes] == [1.0, 1.0]
    assert [code for code, _ in results] == [143, 143], results


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "command",
    [
        ["worker"],
        ["webhooks", "worker"],
        ["gateway", "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:{free}"],
    ],
)
def test_metrics_on_a_port_in_use_exits_2_with_one_line(tmp_path: Path, command: list[str]) -> None:
    """A port already taken: exit 2, one error line naming --metrics, nothing left running."""
    db = f"sqlite:///{tmp_path}/o.db"
    Outbox(db).close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [a.format(free=free_port()) for a in command]
        done = subprocess.run(_cli(*args, "--store", db, "--metrics", f"127.0.0.1:{port}"),
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--metrics" in lines[0] and "already in use" in lines[0]


@pytest.mark.parametrize(
    "address",
    [
        "nonsense",
        "127.0.0.1:99999",
        "127.0.0.1:",
        ":9464",
        "127.0.0.1:0",
        "127.0.0.1:\u0669\u0664\u0667\u0669",  # Arabic-Indic digits are not a port
        "http://127.0.0.1:9474",
        " 127.0.0.1:9478",
        "127.0.0.1:9464/metrics",
    ],
)
def test_an_unparsable_metrics_address_exits_2(tmp_path: Path, address: str) -> None:
    """`--metrics` that is not HOST:PORT: exit 2, the message names the option."""
    db = f"sqlite:///{tmp_path}/o.db"
    Outbox(db).close()
    done = subprocess.run(_cli("worker", "--store", db, "--metrics", address),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--metrics" in done.stderr


@pytest.mark.parametrize(
    ("listen", "metrics"),
    [
        ("127.0.0.1:{p}", "127.0.0.1:{p}"),
        ("127.0.0.1:{p}", "localhost:{p}"),
        ("127.0.0.1:{p}", "0.0.0.0:{p}"),
        ("0.0.0.0:{p}", "127.0.0.1:{p}"),
        ("127.0.0.1:{p}", "127.0.0.1:0{p}"),
    ],
)
def test_gateway_refuses_metrics_on_its_own_listen_address(
    tmp_path: Path, listen: str, metrics: str
) -> None:
    """`--metrics` naming the socket of `--listen`, however spelled: exit 2 before anything
    starts, and before whether the port is free (here it is taken, as it may be by the time
    a parallel test's free port is used: the usage error still comes first)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = subprocess.run(
            _cli("gateway", "--upstream", "http://127.0.0.1:9", "--listen", listen.format(p=port),
                 "--store", f"sqlite:///{tmp_path}/k.db", "--metrics", metrics.format(p=port)),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "own --listen address" in done.stderr
    assert "--metrics" in done.stderr
    assert not (tmp_path / "k.db").exists()


def test_metrics_without_prometheus_client_exits_2_with_the_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """prometheus-client not installed: `--metrics` exits 2 with one line saying how to get
    it (the worker never starts)."""
    from retrysafe.cli import main

    db = f"sqlite:///{tmp_path}/o.db"
    Outbox(db).close()
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    with pytest.raises(SystemExit) as done:
        main(["worker", "--store", db, "--until-idle", "--metrics", f"127.0.0.1:{free_port()}"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'retrysafe[metrics]'" in err[0], err
