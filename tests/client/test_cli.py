"""The outbox commands: `jobs`, `worker`, `reconcile`, `dlq` (JSON output, exit codes)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from retrysafe.cli import cli

from .conftest import Script, Step


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_submit_worker_show_and_list_round_trip(
    sqlite_path: Path, script: Script, base_url: str
) -> None:
    """submit → worker --until-idle → show/list report the job SUCCEEDED with its attempt."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/cli", Step(201))
    code, out, _ = _run("jobs", "submit", base_url + "/cli", "-d", '{"a": 1}', "--store", store,
                        "--json")
    assert code == 0
    job = json.loads(out)
    code, out, _ = _run("worker", "--store", store, "--until-idle", "--wait-initial", "0.01",
                        "--json")
    assert code == 0 and json.loads(out.splitlines()[-1])["succeeded"] == 1
    code, out, _ = _run("jobs", "show", job["id"][:10], "--store", store, "--json")
    shown = json.loads(out)
    assert shown["state"] == "succeeded" and shown["attempt_log"][0]["status"] == 201
    code, out, _ = _run("jobs", "list", "--store", store, "--json")
    assert json.loads(out)["counts"]["succeeded"] == 1
    code, out, _ = _run("jobs", "list", "--store", store)
    assert code == 0 and job["id"][:12] in out


def test_dlq_list_replay_and_purge(sqlite_path: Path, script: Script, base_url: str) -> None:
    """An exhausted job shows in `dlq list`; replay makes it PENDING; purge removes it."""
    store = f"sqlite:///{sqlite_path}"
    script.plan("/dlq", Step(503))
    _run("jobs", "submit", base_url + "/dlq", "--store", store)
    _run("worker", "--store", store, "--until-idle", "--attempts", "1", "--json")
    code, out, _ = _run("dlq", "list", "--store", store, "--json")
    [dead] = json.loads(out)
    assert dead["state"] == "unknown" and len(dead["attempt_log"]) == 1
    code, out, _ = _run("reconcile", "--store", store, "--json")
    assert code == 0 and json.loads(out)["unknown"] == 1
    code, out, _ = _run("dlq", "replay", dead["id"], "--store", store, "--json")
    assert code == 0 and json.loads(out)[0]["state"] == "pending"
    code, out, _ = _run("jobs", "cancel", dead["id"], "--store", store)
    assert code == 0
    code, out, _ = _run("dlq", "purge", "--store", store, "--state", "unknown", "--yes")
    assert code == 0 and "purged 0" in out


def test_errors_are_one_line_and_non_zero(sqlite_path: Path, tmp_path: Path) -> None:
    """Bad URL, unknown job, missing directory: one line on stderr, exit 1, no traceback."""
    store = f"sqlite:///{sqlite_path}"
    for args in (
        ("jobs", "submit", "ftp://example.test/x", "--store", store),
        ("jobs", "show", "deadbeef", "--store", store),
        ("jobs", "list", "--store", f"sqlite:///{tmp_path}/missing/x.db"),
    ):
        code, out, err = _run(*args)
        assert code == 1
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
        assert "Traceback" not in err + out
