"""A child agent process for the kill/resume test (run as a script, killed with SIGKILL).

usage: agent_child.py guarded|naive STORE_URL SERVICE_URL RUN_ID start|resume|join [SCHEMA]
(SCHEMA: the PostgreSQL schema of a postgresql:// store.) ``join`` opens the recorded run
alongside the process that started it (another worker of the same run: nothing is
interrupted), so a call still RUNNING there is waited for until its lease ends.
``AGENT_CHILD_LEASE`` (seconds, default 30) sets the write tool's lease.
Prints the tool's result as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx

from retrysafe.agents import AgentRun, agent_store, instrument, resume_run, start_run, tool
from retrysafe.stores import open_store


def main() -> None:
    mode, store_url, url, run_id, phase = sys.argv[1:6]
    options = {"schema": sys.argv[6]} if len(sys.argv) > 6 else {}
    client = instrument(httpx.Client(timeout=5))

    def post(title: str) -> dict[str, Any]:
        r = client.post(f"{url}/tickets", json={"title": title})
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    if mode == "naive":
        print(json.dumps(post("kill me")), flush=True)
        return

    lease = float(os.environ.get("AGENT_CHILD_LEASE", "30"))
    create_ticket = tool(kind="write", attempts=8, wait_initial=0.05, wait_max=0.2, lease=lease)(
        post
    )
    store = open_store(store_url, **options)
    if phase == "start":
        run = start_run(store, run_id)
    elif phase == "resume":
        run = resume_run(store, run_id, retry_unknown=True)
    else:
        record = agent_store(store).get_agent_run(run_id)
        assert record is not None
        run = AgentRun(store, record)
    with run, run.step(1):
        print(json.dumps(create_ticket("kill me")), flush=True)


if __name__ == "__main__":
    main()
