"""Commands started with a standard stream closed, or a stdout that cannot take the results
(found by a fresh-user pass): a clear line and the right status, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from retrysafe import Outbox


def _shell(command: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize("closed", ["<&-", ">&-", "<&- >&-"])
def test_the_demo_runs_with_stdin_or_stdout_closed(tmp_path: Path, closed: str) -> None:
    """The service's listening socket took descriptor 0 or 1, which its child's /dev/null
    stdin (or log) then replaced: the demo always failed "before it served"."""
    done = _shell(
        f"exec {sys.executable} -m retrysafe demo --jobs 20 --no-naive --concurrency 4 {closed}",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
@pytest.mark.parametrize("json_flag", ["", "--json"])
def test_a_full_stdout_is_one_error_line(tmp_path: Path, json_flag: str) -> None:
    """`retrysafe jobs list >/dev/full`: exit 1 with one line, not an OSError traceback."""
    Outbox(f"sqlite:///{tmp_path}/o.db").close()
    with Outbox(f"sqlite:///{tmp_path}/o.db") as outbox:
        outbox.submit("http://127.0.0.1:9/x", json={})
    done = _shell(
        f"{sys.executable} -m retrysafe jobs list --store sqlite:///{tmp_path}/o.db "
        f"{json_flag} >/dev/full",
        tmp_path,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        "retrysafe: error: cannot write: No space left on device"
    ]
