"""`retrysafe webhooks …`: endpoints, send, worker, dlq (JSON output, clear errors)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from retrysafe.cli import cli

from .conftest import Receiver


def _run(*args: str, input: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["webhooks", *args], input=input)
    return result.exit_code, result.stdout, result.stderr


def test_endpoint_send_worker_dlq_round_trip(
    store_url: str, receiver: Receiver, base_url: str
) -> None:
    """add → send → worker → dlq list/show → replay → purge, all through the CLI."""
    receiver.plan("/cli", 400)
    s = ("--store", store_url)
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
    line = json.loads(out.strip().splitlines()[-1])
    assert line["event_id"] == "evt_cli" and line["status"] == 400
    assert {"endpoint_id", "attempt", "latency_ms", "outcome"} <= set(line)
    assert receiver.requests("/cli")[0].verified
    code, out, _ = _run("dlq", "list", "--json", *s)
    (dead,) = json.loads(out)
    assert dead["state"] == "rejected"
    code, out, _ = _run("dlq", "show", dead["id"][:10], "--json", *s)
    assert [a["status"] for a in json.loads(out)["attempts"]] == [400]
    code, out, _ = _run("dlq", "replay", dead["id"], "--json", *s)
    assert code == 0 and json.loads(out)[0]["state"] == "pending"
    _run("worker", "--until-idle", "--allow-private", *s)
    code, out, _ = _run("dlq", "purge", "--yes", *s)
    assert code == 0 and "purged 1" in out


def test_disable_enable_and_delete(store_url: str, base_url: str) -> None:
    """disable with a reason, enable, delete --yes; then the id is unknown."""
    s = ("--store", store_url)
    code, out, _ = _run("endpoints", "add", base_url + "/x", "--allow-private", "--json", *s)
    ep = json.loads(out)["id"]
    code, out, _ = _run("endpoints", "disable", ep, "--reason", "holiday", "--json", *s)
    assert json.loads(out)["disabled_reason"] == "holiday"
    code, out, _ = _run("endpoints", "enable", ep, "--replay-missed", "--json", *s)
    assert json.loads(out)["enabled"] is True
    code, out, _ = _run("endpoints", "delete", ep, "--yes", *s)
    assert code == 0
    code, _, err = _run("endpoints", "show", ep, *s)
    assert code == 1 and "no endpoint" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("endpoints", "show", "ep_missing"), "no endpoint"),
        (("endpoints", "disable", "ep_missing"), "no endpoint"),
        (("endpoints", "delete", "ep_missing", "--yes"), "no endpoint"),
        (("dlq", "show", "deadbeef"), "no delivery"),
        (("dlq", "replay", "deadbeef"), "no delivery"),
        (("endpoints", "add", "ftp://x/y", "--allow-private"), "not http(s)"),
        (("endpoints", "add", "http://127.0.0.1:9/x"), "SSRF"),
        (
            ("endpoints", "add", "http://127.0.0.1:9/x", "--allow-private", "--secret", "abc"),
            "whsec_",
        ),
        (("send", "a.b", "{not json"), "payload is not JSON"),
        (("send", "bad type!", "{}"), "event type"),
    ],
)
def test_bad_input_is_one_clear_error(store_url: str, args: tuple[str, ...], message: str) -> None:
    """Unknown ids, bad URLs, secrets and payloads: exit 1 and one line on stderr."""
    code, _, err = _run(*args, "--store", store_url)
    assert code == 1
    assert err.startswith("retrysafe: error:") and message in err
    assert "Traceback" not in err
