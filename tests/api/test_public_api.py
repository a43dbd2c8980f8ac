"""One public door per concept (STYLE §3): each public package's ``__all__`` exports every name
the documentation (README.md, docs/*.md) shows, resolves every name it lists, and lists no
private one.

Documented names are found in two ways. Read from the docs when the test runs: every name
imported in a code sample (``from retrysafe.x import A, B``), every qualified reference
(``retrysafe.x.Name``), and every name in code on a package's own page that the package has.
And fixed below, for the names the pages show today: a name that disappears from the package
altogether is caught although the docs still show it.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import types
from pathlib import Path

import pytest

import retrysafe

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Each public package and its own documentation page (README.md for the top level).
PAGES = {
    "retrysafe": "README.md",
    "retrysafe.core": "docs/spec.md",
    "retrysafe.client": "docs/client.md",
    "retrysafe.server": "docs/server.md",
    "retrysafe.stores": "docs/stores.md",
    "retrysafe.webhooks": "docs/webhooks.md",
    "retrysafe.agents": "docs/agents.md",
    "retrysafe.chaos": "docs/chaos.md",
    "retrysafe.testing": "docs/testing.md",
    "retrysafe.django": "docs/django.md",
    "retrysafe.ui": "docs/ui.md",
}

#: The names each package's documentation shows (December 2026).
DOCUMENTED = {
    "retrysafe": {
        "BudgetExceededError", "IdempotencyMiddleware", "Outbox", "OutcomeUnknownError",
        "RetryBudget", "RetryPolicy", "SQLiteStore", "WSGIIdempotencyMiddleware",
        "WebhookVerifier", "Webhooks", "Worker", "reconcile", "resume_run", "start_run",
        "ChaosProxy", "EffectLedger",
    },
    "retrysafe.core": {"Backoff", "RACE_LIMIT", "fingerprint", "key_hash", "key_retention",
                       "scope_from_authorization"},
    "retrysafe.client": {"AsyncOutbox", "Outbox", "RetryBudget", "RetryPolicy", "Worker",
                         "areconcile", "reconcile"},
    "retrysafe.server": {"IdempotencyConfig", "IdempotencyMiddleware",
                         "WSGIIdempotencyMiddleware", "mark_outcome_unknown", "transaction"},
    "retrysafe.stores": {"AsyncKeyStore", "KeyStore", "MemoryStore", "PostgresStore",
                         "RedisStore", "SQLiteStore", "open_store"},
    "retrysafe.webhooks": {"DestinationRefusedError", "EndpointNotFoundError", "Receipt",
                           "Schedule", "WebhookMiddleware", "WebhookVerifier", "Webhooks",
                           "verify"},
    "retrysafe.agents": {"AgentCall", "AsyncIdempotencyKeyTransport", "IdempotencyKeyTransport",
                         "agent_store", "call_id", "current_call_key", "instrument",
                         "is_retryable", "resume_run", "start_run", "tool"},
    "retrysafe.chaos": {"ChaosProxy", "EffectLedger", "FaultRates", "Report", "build_report",
                        "print_reports"},
    "retrysafe.testing": {"is_testing", "no_waiting", "set_testing", "waited"},
    "retrysafe.django": {"DjangoStore", "IdempotencyMiddleware", "mark_outcome_unknown"},
    "retrysafe.ui": {"console_app"},
}  # fmt: skip

_IMPORT = re.compile(r"from (retrysafe(?:\.[a-z]+)?) import (?:\(([^)]*)\)|([\w, ]+))")
_QUALIFIED = re.compile(r"\b(retrysafe\.[a-z]+)\.([A-Za-z]\w*)")
_CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)


def _code(text: str) -> str:
    return "\n".join(_CODE.findall(text))


def _is_submodule(package: str, name: str) -> bool:
    """``retrysafe.agents.langgraph`` names a module (an optional integration), not an export."""
    try:
        return importlib.util.find_spec(f"{package}.{name}") is not None
    except ModuleNotFoundError:  # ``package`` is a module (retrysafe.testing)
        return False


def documented_in_docs(module: str) -> set[str]:
    """The names of ``module`` the docs show (see the module docstring)."""
    names: set[str] = set()
    for path in DOCS:
        code = _code(path.read_text())
        for mod, in_parens, on_line in _IMPORT.findall(code):
            if mod == module:
                listed = (in_parens or on_line).replace("\n", ",").split(",")
                names |= {n.strip() for n in listed if n.strip()}
        names |= {
            name
            for mod, name in _QUALIFIED.findall(code)
            if mod == module and not _is_submodule(mod, name)
        }
    page = ROOT / PAGES[module]
    if page.exists():
        mod_obj = importlib.import_module(module)
        for name in set(re.findall(r"(?<![\w.])([A-Za-z]\w*)", _code(page.read_text()))):
            value = vars(mod_obj).get(name)
            if value is not None and not isinstance(value, types.ModuleType):
                names.add(name)
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("module", sorted(PAGES))
def test_every_documented_name_is_exported(module: str) -> None:
    """Each name the documentation shows for a package is in that package's ``__all__``."""
    exported = set(importlib.import_module(module).__all__)
    wanted = DOCUMENTED[module] | documented_in_docs(module)
    assert sorted(wanted - exported) == []


def _ruff_order(name: str) -> tuple[int, str]:
    """ruff's isort-style order for ``__all__``: CONSTANTS, then Classes, then the rest."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


@pytest.mark.parametrize("module", sorted(PAGES))
def test_all_lists_only_public_names_that_resolve(module: str) -> None:
    """``__all__`` names no private (``_x``) name, has no duplicates, is sorted the way ruff
    sorts it (constants, classes, the rest), and every name in it resolves (lazy ones too)."""
    mod = importlib.import_module(module)
    names = list(mod.__all__)
    dunder = [n for n in names if n.startswith("__") and n.endswith("__")]  # __version__
    private = [n for n in names if n.startswith("_") and n not in dunder]
    assert private == []
    assert len(set(names)) == len(names)
    assert names == sorted(names, key=_ruff_order)
    missing = [n for n in names if not hasattr(mod, n)]
    assert missing == []


@pytest.mark.parametrize(
    "module", ["retrysafe.client", "retrysafe.server", "retrysafe.stores", "retrysafe.agents",
               "retrysafe.chaos", "retrysafe.webhooks"]
)  # fmt: skip
def test_top_level_names_are_the_packages_own_objects(module: str) -> None:
    """A name exported both by ``retrysafe`` and a package is the same object in both."""
    mod = importlib.import_module(module)
    shared = set(retrysafe.__all__) & set(mod.__all__)
    assert [n for n in sorted(shared) if getattr(retrysafe, n) is not getattr(mod, n)] == []


def test_the_docs_scan_finds_what_the_pages_show() -> None:
    """The scan of the docs is not vacuous: it finds names imported in README samples,
    qualified references and names on a package's own page."""
    assert {"Outbox", "RetryPolicy"} <= documented_in_docs("retrysafe")
    assert {"RACE_LIMIT", "key_retention", "Backoff"} <= documented_in_docs("retrysafe.core")
    assert {"PostgresStore", "open_store"} <= documented_in_docs("retrysafe.stores")


def test_importing_the_package_loads_its_exceptions_alone() -> None:
    """``import retrysafe`` loads no client, server, store or asyncio (a command line starts,
    and can handle Ctrl-C, that much sooner); each name loads on first use, and is the
    object of the module that defines it."""
    import subprocess
    import sys

    code = (
        "import sys, retrysafe; "
        "print(sorted(m for m in sys.modules if m.startswith('retrysafe.') "
        "and m != 'retrysafe._exceptions')); print('asyncio' in sys.modules); "
        "from retrysafe import Outbox; import retrysafe.client as c; print(Outbox is c.Outbox)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:3] == ["[]", "False", "True"], out.stdout
    assert retrysafe.Worker is importlib.import_module("retrysafe.client").Worker
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        retrysafe.Nope  # noqa: B018
    assert set(retrysafe.__all__) <= set(dir(retrysafe))
