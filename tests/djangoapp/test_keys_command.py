"""``manage.py retrysafe_keys`` is ``retrysafe keys`` on the configured store (Django's
database by default): the same commands, --json and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import pytest

from .conftest import TESTS, _env


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A migrated project database with two completed keys (``k-done``, ``k-evict``) and
    its env (one per module: only the evict test changes a key, its own)."""
    db = tmp_path_factory.mktemp("keys") / "db.sqlite3"
    env = _env({"RS_SQLITE": str(db)}, {"STORE": "django"})
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
        env=env,
        check=True,
        timeout=60,
        cwd=TESTS,
    )
    code = (
        "import django, json; django.setup()\n"
        "from django.test import Client\n"
        "for key in ('k-done', 'k-evict'):\n"
        "    r = Client().post('/charge', data='{}', content_type='application/json',"
        " headers={'Idempotency-Key': key})\n"
        "    assert r.status_code == 201, r.status_code\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60, cwd=TESTS)
    return env


def _keys(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "django", "retrysafe_keys", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=TESTS,
        stdin=subprocess.DEVNULL,
    )


def test_list_json_names_django_database_and_its_keys(project: dict[str, str]) -> None:
    """`list --json`: the store is named as Django's database; the key is there, completed."""
    out = _keys(project, "list", "--json")
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    assert data["store"].startswith("django:default (sqlite ")
    assert len(data["keys"]) == 2  # k-done and k-evict (evicted by another test, maybe)
    assert "completed" in {k["state"] for k in data["keys"]}


def test_show_by_key_gives_the_stored_status(project: dict[str, str]) -> None:
    """`show KEY --json`: state, status and headers of the stored answer."""
    out = _keys(project, "show", "k-done", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["state"] == "completed" and data["status"] == 201


def test_show_unknown_key_exits_1(project: dict[str, str]) -> None:
    """A key that is not there: exit 1 and a line saying so."""
    out = _keys(project, "show", f"nope-{uuid.uuid4().hex}")
    assert out.returncode == 1
    assert "no key" in out.stderr.lower()


def test_evict_without_yes_off_a_terminal_is_a_usage_error(project: dict[str, str]) -> None:
    """`evict` cannot ask without a terminal: exit 2, nothing changed."""
    out = _keys(project, "evict", "k-done")
    assert out.returncode == 2
    assert "--yes" in out.stderr
    assert json.loads(_keys(project, "show", "k-done", "--json").stdout)["state"] == "completed"


def test_evict_yes_forgets_the_key(project: dict[str, str]) -> None:
    """`evict --yes`: the key is released; the next request with it runs the view again."""
    out = _keys(project, "evict", "k-evict", "--yes", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["evicted"] is True
    assert json.loads(_keys(project, "show", "k-evict", "--json").stdout)["state"] == "released"


def test_bad_usage_exits_2_with_click_help(project: dict[str, str]) -> None:
    """An unknown subcommand is a usage error (exit 2), as for `retrysafe keys`."""
    out = _keys(project, "frobnicate")
    assert out.returncode == 2
    assert "manage.py retrysafe_keys" in out.stderr
