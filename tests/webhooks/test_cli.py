"""`retrysafe webhooks …`: endpoints, send, worker, dlq (JSON output, clear errors)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from retrysafe.cli import cli

from .conftest import Receiver


def _run(*args: str, input: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["webhooks", *args], input=input)
    return result.exit_code, result.stdout, result.stderr


def _create(store_url: str) -> None:
    """Create the store (on PostgreSQL in the test's schema): no command but `retrysafe
    migrate` creates one."""
    from retrysafe.webhooks import Webhooks

    Webhooks(store_url).close()


def test_endpoint_send_worker_dlq_round_trip(
    store_url: str, receiver: Receiver, base_url: str
) -> None:
    """add → send → worker → dlq list/show → replay → purge, all through the CLI."""
    receiver.plan("/cli", 400)
    s = ("--store", store_url)
    _create(store_url)
    code, out, err = _run(
        "endpoints", "add", base_url + "/cli", "-e", "order.*", "--allow-private", "--json", *s
    )
    assert code == 0, err
    ep = json.loads(out)
    receiver.secrets["/cli"] = ep["secrets"][0]["secret"]
    code, out, _ = _run("endpoints", "list", "--json", *s)
    assert [e["id"] for e in json.loads(out)] == [ep["id"]]
    assert json.loads(out)[0]["secrets"] == 1  # listed without the secret itself
    code, out, _ = _run("send", "order.created", '{"n": 1}', "--id", "evt_cli", "--json", *s)
    assert code == 0 and len(json.loads(out)["deliveries"]) == 1
    code, out, _ = _run("worker", "--until-idle", "--allow-private", *s)
    assert code == 0
    lines = [json.loads(x) for x in out.strip().splitlines()]
    [line] = [x for x in lines if x.get("event") == "attempt"]
    assert lines[-1]["event"] == "stopped" and lines[-1]["rejected"] == 1
    assert line["event_id"] == "evt_cli" and line["status"] == 400
    assert {"endpoint_id", "attempt", "latency_ms", "outcome"} <= set(line)
    assert receiver.requests("/cli")[0].verified
    code, out, _ = _run("dlq", "list", "--json", *s)
    (dead,) = json.loads(out)
    assert dead["state"] == "rejected"
    code, out, _ = _run("dlq", "show", dead["id"][:10], "--json", *s)
    assert [a["status"] for a in json.loads(out)["attempts"]] == [400]
    code, out, err = _run("dlq", "replay", dead["id"], "--all", *s)
    assert code == 2 and "not both" in err  # which was meant? nothing replayed
    code, out, _ = _run("dlq", "list", "--json", *s)
    assert [d["state"] for d in json.loads(out)] == ["rejected"]
    code, out, _ = _run("dlq", "replay", dead["id"], *s)
    assert (code, out) == (0, "replayed 1 delivery\n")
    _run("worker", "--until-idle", "--allow-private", *s)
    code, out, _ = _run("dlq", "purge", "--yes", *s)
    assert code == 0 and "purged 1" in out


def test_disable_enable_and_delete(store_url: str, base_url: str) -> None:
    """disable with a reason, enable, delete --yes (and --json); then the id is unknown."""
    s = ("--store", store_url)
    _create(store_url)
    code, out, _ = _run("endpoints", "add", base_url + "/x", "--allow-private", "--json", *s)
    ep = json.loads(out)["id"]
    code, out, _ = _run("endpoints", "disable", ep, "--reason", "holiday", "--json", *s)
    assert json.loads(out)["disabled_reason"] == "holiday"
    code, out, _ = _run("endpoints", "enable", ep, "--replay-missed", "--json", *s)
    assert json.loads(out)["enabled"] is True
    code, out, _ = _run("endpoints", "delete", ep, "--yes", "--json", *s)
    assert code == 0 and json.loads(out) == {"deleted": ep}
    code, _, err = _run("endpoints", "show", ep, *s)
    assert code == 1 and "no endpoint" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("endpoints", "show", "ep_0123"), "no endpoint"),
        (("endpoints", "disable", "ep_0123"), "no endpoint"),
        (("endpoints", "delete", "ep_0123", "--yes"), "no endpoint"),
        (("dlq", "show", "deadbeef"), "no delivery"),
        (("dlq", "replay", "deadbeef"), "no delivery"),
    ],
)
def test_unknown_ids_are_one_clear_error(
    store_url: str, args: tuple[str, ...], message: str
) -> None:
    """Unknown endpoint and delivery ids: the operation failed, exit 1 and one line."""
    _create(store_url)  # an existing store (no command but migrate creates one)
    code, _, err = _run(*args, "--store", store_url)
    assert code == 1
    assert err.startswith("retrysafe: error:") and message in err and err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("endpoints", "show", "ep_missing"), "ENDPOINT_ID: 'ep_missing' is not an endpoint id"),
        (("dlq", "show", "nothex"), "DELIVERY_ID: 'nothex' is not a delivery id"),
        (("endpoints", "add", "ftp://x/y", "--allow-private"), "URL: url 'ftp://x/y' is not"),
        (("endpoints", "add", "http://127.0.0.1:9/x"), "URL: http://127.0.0.1:9/x resolves to"),
        (
            ("endpoints", "add", "http://127.0.0.1:9/x", "--allow-private", "--secret", "abc"),
            "--secret: ",
        ),
        (("send", "a.b", "{not json"), "PAYLOAD: the argument is not JSON"),
        (("send", "bad type!", "{}"), "EVENT_TYPE: event type 'bad type!'"),
        (("send", "a.b", "NaN"), "PAYLOAD: payload cannot be serialised"),
    ],
)
def test_bad_input_is_one_clear_error_naming_the_option(
    store_url: str, args: tuple[str, ...], message: str
) -> None:
    """Ids that cannot be ids, bad URLs (a refused destination too), secrets, event types and
    payloads: bad input, exit 2 and one line naming the option; nothing recorded."""
    from retrysafe.webhooks import Webhooks

    _create(store_url)
    code, _, err = _run(*args, "--store", store_url)
    assert code == 2, err
    assert err.startswith(f"retrysafe: error: {message}") and err.count("\n") == 1, err
    assert "Traceback" not in err
    with Webhooks(store_url) as hooks:
        assert hooks.list_endpoints() == [] and hooks.deliveries() == []


def test_a_payload_file_that_is_not_utf8_is_one_clear_error(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """send @file with bytes that are not UTF-8: bad input, one line naming PAYLOAD, the file
    and the byte, exit 2, and no store written."""
    store_url = sqlite_url  # a file that must not appear
    (tmp_path / "bad.bin").write_bytes(b"\xff\xfe")
    monkeypatch.chdir(tmp_path)
    code, _, err = _run("send", "invoice.paid", "@bad.bin", "--store", store_url)
    assert code == 2
    assert err == "retrysafe: error: PAYLOAD: bad.bin is not UTF-8 text (byte 0)\n"
    assert not Path(store_url.removeprefix("sqlite:///")).exists()


def test_a_stdin_payload_that_is_not_utf8_is_one_clear_error(sqlite_url: str) -> None:
    """send - with bytes that are not UTF-8 says so, not "payload is not JSON"."""
    store_url = sqlite_url  # refused before any store is opened
    result = CliRunner().invoke(
        cli, ["webhooks", "send", "invoice.paid", "-", "--store", store_url], input=b"\xff\xfe"
    )
    assert result.exit_code == 2
    assert result.stderr == "retrysafe: error: PAYLOAD: stdin is not UTF-8 text (byte 0)\n"


@pytest.mark.parametrize(
    "args",
    [
        ("endpoints", "list"),
        ("endpoints", "show", "ep_0"),
        ("dlq", "list"),
        ("dlq", "show", "ab"),
        ("endpoints", "add", "http://127.0.0.1:9/x", "--allow-private"),
        ("endpoints", "update", "ep_0", "--description", "d"),
        ("endpoints", "disable", "ep_0"),
        ("endpoints", "enable", "ep_0"),
        ("endpoints", "delete", "ep_0", "--yes"),
        ("send", "a.b", "{}"),
        ("dlq", "replay", "--all"),
        ("dlq", "purge", "--yes"),
        ("worker", "--until-idle"),
    ],
)
def test_no_command_creates_a_store(tmp_path: Path, args: tuple[str, ...]) -> None:
    """A command on a missing SQLite file, reading or changing, is one error (exit 2, the
    hint to run `retrysafe migrate`) and creates nothing."""
    missing = tmp_path / "nothere.db"
    code, _, err = _run(*args, "--store", f"sqlite:///{missing}")
    assert code == 2
    assert err == (
        f"retrysafe: error: --store: no store at {missing} (create it with `retrysafe migrate "
        f"--store sqlite:///{missing}`, or pass the right --store)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_rate_limit_and_no_rate_limit_together_are_a_usage_error(sqlite_url: str) -> None:
    """update --rate-limit N --no-rate-limit is refused as contradictory (exit 2)."""
    store_url = sqlite_url  # refused before any store is opened
    code, _, err = _run(
        "endpoints", "update", "ep_0", "--rate-limit", "5", "--no-rate-limit", "--store", store_url
    )
    assert code == 2 and "--no-rate-limit" in err


def test_a_host_that_does_not_resolve_is_one_clear_error(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registration resolves the host: offline, endpoints add says so in one line."""

    def offline(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    _create(store_url)
    monkeypatch.setattr(socket, "getaddrinfo", offline)
    code, _, err = _run("endpoints", "add", "https://example.com/hooks", "--store", store_url)
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err
    assert err == (
        "retrysafe: error: https://example.com/hooks: host 'example.com' does not resolve "
        "(Name or service not known)\n"
    )


def test_the_worker_warns_on_stderr_about_endpoints_it_will_refuse(store_url: str) -> None:
    """An endpoint added with --allow-private and a worker started without it: one warning
    line on stderr telling to pass --allow-private to the worker too."""
    s = ("--store", store_url)
    _create(store_url)
    code, _, err = _run("endpoints", "add", "http://127.0.0.1:9/x", "--allow-private", *s)
    assert code == 0, err
    code, _, err = _run("worker", "--until-idle", *s)
    assert code == 0
    (line,) = err.splitlines()
    assert line.startswith("retrysafe: warning: endpoint ep_") and "--allow-private" in line


def test_update_rotates_and_moves_an_endpoint(store_url: str, base_url: str) -> None:
    """endpoints update: --rotate prints both secrets, --url and --no-rate-limit change it."""
    s = ("--store", store_url)
    _create(store_url)
    code, out, err = _run(
        "endpoints", "add", base_url + "/u", "--rate-limit", "5", "--allow-private", "--json", *s
    )
    assert code == 0, err
    ep = json.loads(out)
    code, out, err = _run("endpoints", "update", ep["id"][:8], "--rotate", "--json", *s)
    assert code == 0, err
    rotated = json.loads(out)["secrets"]
    assert len(rotated) == 2 and rotated[1]["secret"] == ep["secrets"][0]["secret"]
    code, out, err = _run(
        "endpoints", "update", ep["id"], "--url", base_url + "/v", "--no-rate-limit",
        "--allow-private", "--json", *s,
    )  # fmt: skip
    assert code == 0, err
    moved = json.loads(out)
    assert moved["url"] == base_url + "/v" and moved["rate_limit"] is None


def test_an_endpoint_of_another_store_is_not_found(
    sqlite_url: str, pg_store_url: str, base_url: str
) -> None:
    """An endpoint added on SQLite and looked up on PostgreSQL: exit 1 and one "no endpoint"
    line naming the PostgreSQL store, for every command that takes an endpoint id."""
    _create(sqlite_url)
    code, out, err = _run(
        "endpoints", "add", base_url + "/x", "--allow-private", "--json", "--store", sqlite_url
    )
    assert code == 0, err
    ep = json.loads(out)["id"]
    from retrysafe import stores

    stores.open_store(pg_store_url).close()  # a PostgreSQL store with retrysafe's tables
    for args in (
        ("endpoints", "show", ep),
        ("endpoints", "update", ep, "--description", "d"),
        ("endpoints", "disable", ep),
        ("endpoints", "enable", ep),
        ("endpoints", "delete", ep, "--yes"),
        ("dlq", "list", "--endpoint", ep),
        ("dlq", "replay", "--endpoint", ep),
        ("dlq", "purge", "--endpoint", ep, "--yes"),
    ):
        code, _, err = _run(*args, "--store", pg_store_url)
        assert code == 1, args
        assert err.startswith("retrysafe: error: no endpoint") and "postgresql://" in err, err
        assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("args", [("endpoints", "list"), ("dlq", "list")])
def test_reading_commands_never_create_postgres_tables(
    pg_store_url: str, pg_schema: str, args: tuple[str, ...]
) -> None:
    """A reading command on a PostgreSQL database without retrysafe's tables is one error
    naming `retrysafe migrate`, and creates nothing."""
    import psycopg

    code, _, err = _run(*args, "--store", pg_store_url)
    assert code == 1 and err.startswith("retrysafe: error:") and "retrysafe migrate" in err
    with psycopg.connect(pg_store_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = %s", (pg_schema,)
        ).fetchone()
    assert row == (0,)


@pytest.mark.parametrize(
    ("what", "command"),
    [
        ("deliveries", "`retrysafe webhooks dlq replay --all`"),
        ("jobs", "`retrysafe reconcile`"),
    ],
)
def test_a_worker_left_with_unknown_names_the_command_that_sends_them_again(
    capsys: pytest.CaptureFixture[str], what: str, command: str
) -> None:
    """UNKNOWN deliveries are sent again by a replay from the dead-letter queue (signed, on
    their schedule): the webhook worker named `retrysafe reconcile`, which sends only
    outbox jobs, and said "reconciled 0"."""
    from retrysafe import WorkerStats
    from retrysafe.cli._client import Served, finish

    with pytest.raises(SystemExit) as exit_:
        finish(Served(WorkerStats(unknown=2), None), until_idle=True, what=what)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert f"{what} left UNKNOWN: 2" in err and command in err


def test_send_refuses_a_payload_over_max_payload_and_says_how_to_raise_it(
    store_url: str, tmp_path: Path
) -> None:
    """`webhooks send` records at most --max-payload bytes of JSON (default 1 MiB): past it,
    one error line naming the option, exit 2, nothing recorded; the option raises it, and
    one delivery reads "1 delivery"."""
    _create(store_url)
    s = ("--store", store_url)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"a": "x" * (1024 * 1024)}))
    code, out, err = _run("send", "a.b", f"@{big}", "--id", "evt_big", *s)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "nothing recorded" in err
    # The option the command line has, not the Python one.
    assert "(--max-payload BYTES raises it)" in err and "WebhookPolicy" not in err
    raised = ("--max-payload", "2000000")
    code, out, err = _run("send", "a.b", f"@{big}", "--id", "evt_big", *raised, *s)
    assert code == 0 and out.startswith("event evt_big (a.b): 0 deliveries"), (out, err)
    code, out, err = _run("send", "a.b", "{}", "--max-payload", "0", *s)
    assert code == 2 and "--max-payload" in err
    code, out, err = _run(
        "endpoints", "add", "http://127.0.0.1:9/x", "-e", "c.d", "--allow-private", *s
    )
    assert code == 0, err
    code, out, err = _run("send", "c.d", "{}", *s)
    assert code == 0 and out.rstrip().endswith("1 delivery"), out


def _worker_processes(*args: str) -> tuple[int, str, str]:
    """`retrysafe webhooks worker ARGS` in a child process (it forks its --processes)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "retrysafe", "webhooks", "worker", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


def test_the_worker_delivers_with_several_processes_once_each(
    sqlite_url: str, receiver: Receiver, base_url: str
) -> None:
    """`webhooks worker --processes 3`: every event delivered once, signed; one summary line
    with the totals of the three; the warning about a refused endpoint said once, not per
    process. (SQLite: the worker runs in a child process, which the tests' PostgreSQL
    schema does not reach.)"""
    s = ("--store", sqlite_url)
    _create(sqlite_url)
    code, out, err = _run("endpoints", "add", base_url + "/p", "--allow-private", "--json", *s)
    assert code == 0, err
    receiver.secrets["/p"] = json.loads(out)["secrets"][0]["secret"]
    for n in range(12):
        code, _, err = _run("send", "order.created", json.dumps({"n": n}), *s)
        assert code == 0, err
    code, out, err = _worker_processes("--until-idle", "--allow-private", "--processes", "3", *s)
    assert code == 0, err
    seen = receiver.requests("/p")
    assert len(seen) == 12 and all(r.verified for r in seen)
    lines = [json.loads(x) for x in out.strip().splitlines()]
    assert [x["event"] for x in lines].count("stopped") == 1 and lines[-1]["succeeded"] == 12
    assert [x["event"] for x in lines].count("attempt") == 12
    code, _, err = _worker_processes("--until-idle", "--processes", "3", *s)  # loopback
    assert code == 0, err
    (line,) = err.splitlines()
    assert line.startswith("retrysafe: warning: endpoint ep_") and "--allow-private" in line


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("--lease", "0"), "--lease"),
        (("--lease", "nan"), "--lease"),
        (("--lease", "5", "--heartbeat", "5"), "--heartbeat"),
        (("--max-run-time", "1e12"), "--max-run-time"),
    ],
)
def test_the_worker_takes_lease_flags_and_refuses_bad_ones_first(
    tmp_path: Path, args: tuple[str, ...], option: str
) -> None:
    """`retrysafe webhooks worker` had no --lease (a note's gap: a dead webhook worker's
    deliveries always waited 10 s, the outbox worker's the lease one chose). Bad values exit
    2 naming the flag, before any store is opened."""
    db = tmp_path / "none.db"
    code, _, err = _run("worker", "--until-idle", "--store", f"sqlite:///{db}", *args)
    assert code == 2 and option in err and "No such option" not in err, err
    assert not db.exists()


def test_the_workers_lease_is_the_one_given(
    sqlite_url: str, receiver: Receiver, base_url: str
) -> None:
    """--lease reaches the worker: while the attempt is in flight, its delivery is leased for
    about 2 s, not the default 10, so a worker that dies mid-attempt holds it that long."""
    import time

    from retrysafe import Outbox

    _create(sqlite_url)
    path = receiver.plan("/leased", 200)
    s = ("--store", sqlite_url)
    code, out, err = _run(
        "endpoints", "add", base_url + path, "-e", "t.*", "--allow-private", "--json", *s
    )
    assert code == 0, err
    receiver.secrets[path] = json.loads(out)["secrets"][0]["secret"]
    leased_for: list[float] = []

    def look() -> None:
        with Outbox(sqlite_url, queue="webhooks") as outbox:
            (job,) = outbox.jobs()
            assert job.lease_expires_at is not None
            leased_for.append(job.lease_expires_at - time.time())

    receiver.before_answer[path] = look
    assert _run("send", "t.x", "{}", *s)[0] == 0
    code, _, err = _run(
        "worker", "--until-idle", "--allow-private", "--lease", "2", "--heartbeat", "0.5", *s
    )
    assert code == 0, err
    assert len(leased_for) == 1 and 0 < leased_for[0] <= 2.0, leased_for
