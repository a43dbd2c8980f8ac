"""Make files and directories unwritable for a while, as root too (the tests run as root).

``chmod`` stops an ordinary user; root ignores it, so as root the paths are also marked
immutable (``chattr +i``), which stops root. When neither works the test is skipped, except under
``CI=true``, where it fails: a missing tool must not hide the test.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK)


def _chattr(flag: str, path: Path) -> bool:
    try:
        done = subprocess.run(["chattr", flag, str(path)], capture_output=True, check=False)
    except FileNotFoundError:
        return False
    return done.returncode == 0


class ReadOnly:
    """``with ReadOnly(file, directory) as ro:`` — no path can be written until
    ``ro.restore()`` or the end of the block (which restores too). Idempotent restore."""

    def __init__(self, *paths: Path) -> None:
        self.paths = [Path(p) for p in paths]
        self._modes = {p: p.stat().st_mode & 0o7777 for p in self.paths}
        self._immutable: list[Path] = []
        self._active = False

    def __enter__(self) -> ReadOnly:
        self._active = True
        try:
            for p in self.paths:
                p.chmod(0o555 if p.is_dir() else 0o444)
            for p in self.paths:
                if _writable(p) and _chattr("+i", p):
                    self._immutable.append(p)
            still = [str(p) for p in self.paths if _writable(p)]
        except BaseException:
            self.restore()
            raise
        if still:
            self.restore()
            reason = f"cannot make {still} read-only here (chmod ignored, chattr +i failed)"
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"{reason}; under CI=true this test must run, not skip")
            pytest.skip(reason)
        return self

    def restore(self) -> None:
        """Make every path writable again, as it was."""
        if not self._active:
            return
        self._active = False
        for p in self._immutable:
            if not _chattr("-i", p):
                raise RuntimeError(f"chattr -i {p} failed")
        self._immutable.clear()
        for p, mode in self._modes.items():
            p.chmod(mode)

    def __exit__(self, *exc: object) -> None:
        self.restore()
