"""``retrysafe agents runs|calls``: the audit log as a table or JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from retrysafe.agents import BudgetExceededError, start_run, tool
from retrysafe.cli import cli
from retrysafe.stores import open_store

from .conftest import StoreSpec


@pytest.fixture
def recorded(agent_store_spec: StoreSpec, monkeypatch: pytest.MonkeyPatch) -> str:
    """A store with one run: two calls and a refusal; its URL (on PostgreSQL the CLI opens the
    test's schema: a URL cannot name one)."""
    spec = agent_store_spec
    if spec.schema is not None:

        def open_in_schema(url: str, **options: Any) -> Any:
            if url.startswith("postgresql:"):
                options["schema"] = spec.schema
            return open_store(url, **options)

        monkeypatch.setattr("retrysafe.stores.open_store", open_in_schema)

    @tool(kind="write")
    def create_ticket(title: str) -> dict[str, str]:
        return {"id": "T-1", "title": title}

    with spec.open() as store, start_run(store, "run-1", max_steps=2) as run:
        for title in ("a", "b", "c"):
            with run.step():
                try:
                    create_ticket(title)
                except BudgetExceededError:
                    break
    return spec.url


def test_runs_json(recorded: str) -> None:
    """``agents runs --json`` lists the run, its budget, counts and why it stopped."""
    out = CliRunner().invoke(cli, ["agents", "runs", "--store", recorded, "--json"])
    assert out.exit_code == 0, out.output
    (run,) = json.loads(out.output)
    assert run["id"] == "run-1" and run["calls"] == 2 and run["state"] == "stopped"
    assert "step budget exhausted" in run["reason"]


def test_calls_json_and_table(recorded: str) -> None:
    """``agents calls RUN_ID`` shows one row per logical call, with keys and states."""
    out = CliRunner().invoke(cli, ["agents", "calls", "run-1", "--store", recorded, "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [(r["step"], r["state"], r["arguments"]["title"]) for r in rows] == [
        (1, "succeeded", "a"),
        (2, "succeeded", "b"),
        (3, "refused", "c"),
    ]
    assert all(r["key"].startswith("agent-") for r in rows)
    table = CliRunner().invoke(cli, ["agents", "calls", "run-1", "--store", recorded])
    assert table.exit_code == 0 and "refused" in table.output and "create_ticket" in table.output
    runs = CliRunner().invoke(cli, ["agents", "runs", "--store", recorded])
    assert runs.exit_code == 0 and "run-1" in runs.output


def test_unknown_run_and_missing_store(recorded: str, tmp_path: Path) -> None:
    """An unknown run id is one error line, exit 1; a store file that does not exist is bad
    input (exit 2, naming --store and `retrysafe migrate`) and is not created."""
    out = CliRunner().invoke(cli, ["agents", "calls", "nope", "--store", recorded])
    assert out.exit_code == 1 and "no agent run 'nope'" in out.output
    missing = f"sqlite:///{tmp_path / 'missing.db'}"
    out = CliRunner().invoke(cli, ["agents", "runs", "--store", missing])
    assert out.exit_code == 2
    assert out.stderr.startswith("retrysafe: error: --store: no store at ")
    assert "retrysafe migrate" in out.stderr and out.stderr.count("\n") == 1
    assert not (tmp_path / "missing.db").exists()


def test_calls_json_carries_json_values(recorded: str) -> None:
    """``agents calls --json`` gives ``arguments`` and ``result`` as JSON values, not text."""
    out = CliRunner().invoke(cli, ["agents", "calls", "run-1", "--store", recorded, "--json"])
    rows = json.loads(out.output)
    assert rows[0]["arguments"] == {"title": "a"}
    assert rows[0]["result"] == {"id": "T-1", "title": "a"}
    assert rows[2]["result"] is None
    assert not {"arguments_json", "result_json"} & set(rows[0])


def test_calls_table_fits_80_columns_with_short_keys(recorded: str) -> None:
    """In 80 columns the table shows each key shortened on one line, no line wider than 80."""
    out = CliRunner().invoke(
        cli, ["agents", "calls", "run-1", "--store", recorded], env={"COLUMNS": "80"}
    )
    rows = json.loads(
        CliRunner().invoke(cli, ["agents", "calls", "run-1", "--store", recorded, "--json"]).output
    )
    assert max(len(line) for line in out.output.splitlines()) <= 80
    for r in rows:
        assert f"{r['key'][:12]}…{r['key'][-8:]}" in out.output
        assert r["key"] not in out.output


def test_calls_wide_shows_full_keys(recorded: str) -> None:
    """``agents calls --wide`` shows every key in full on one line."""
    out = CliRunner().invoke(
        cli, ["agents", "calls", "run-1", "--store", recorded, "--wide"], env={"COLUMNS": "200"}
    )
    rows = json.loads(
        CliRunner().invoke(cli, ["agents", "calls", "run-1", "--store", recorded, "--json"]).output
    )
    assert out.exit_code == 0, out.output
    assert all(r["key"] in out.output for r in rows)
