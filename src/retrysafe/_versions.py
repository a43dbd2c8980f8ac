"""The one rule for the optional framework integrations' version checks (Django, the OpenAI
Agents SDK, LangGraph): each imports its framework only after :func:`require` accepted it."""

from __future__ import annotations

import re
from importlib import metadata

from retrysafe._exceptions import ConfigurationError

__all__ = ["require", "specifier"]

Version = tuple[int, int]


def specifier(lowest: Version, beyond: Version) -> str:
    """``(4, 2), (7, 0)`` → ``">=4.2,<7"``: the range as a PEP 440 specifier."""
    high = f"{beyond[0]}" if beyond[1] == 0 else f"{beyond[0]}.{beyond[1]}"
    return f">={lowest[0]}.{lowest[1]},<{high}"


def require(
    distribution: str, *, label: str, user: str, lowest: Version, beyond: Version, extra: str
) -> str:
    """Check that ``distribution`` is installed at a major.minor in ``[lowest, beyond)``.

    Args:
        distribution: the PyPI name (``"openai-agents"``); ``label``: how messages name it
            (``"Django"``); ``user``: the retrysafe module that needs it; ``extra``: the
            retrysafe extra that installs a supported one.

    Returns:
        The installed version.

    Raises:
        ImportError: it is not installed (the message names the extra).
        ConfigurationError: its version is outside the range or unreadable (the message names
            the version found and the range; ``option`` is ``distribution``).
    """
    try:
        found = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise ImportError(
            f"{user} needs {label} {specifier(lowest, beyond)}: pip install 'retrysafe[{extra}]'",
            name=distribution,
        ) from None
    match = re.match(r"(\d+)\.(\d+)", found)
    if match is None or not lowest <= (int(match[1]), int(match[2])) < beyond:
        raise ConfigurationError(
            f"{user} supports {label} {specifier(lowest, beyond)}; found {label} {found}. "
            f"Install a supported one: pip install 'retrysafe[{extra}]'",
            option=distribution,
        )
    return found
