"""Loads the named SQL blocks of ``sql/*.sql`` (one place for every statement a store runs)."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

__all__ = ["queries"]

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


@cache
def queries(dialect: str) -> dict[str, str]:
    """Return ``{name: statement}`` for ``sql/<dialect>.sql``."""
    text = resources.files("retrysafe.stores").joinpath(f"sql/{dialect}.sql").read_text("utf-8")
    parts = _NAME.split(text)
    out: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
        out[name] = "\n".join(lines).strip()
    return out
