"""``manage.py retrysafe_keys list|show|evict``: ``retrysafe keys`` on the store the
``RETRYSAFE`` setting names (Django's database by default), with the same options, output,
``--json`` and exit codes (0 done, 1 failed, 2 usage)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

_PROG = "manage.py retrysafe_keys"


def _run(args: list[str]) -> int:
    """Run ``retrysafe keys ARGS`` on the configured store; returns the exit code."""
    from retrysafe.cli._keys import KeyAdminSource, keys
    from retrysafe.django._middleware import _open
    from retrysafe.django._settings import SETTING, load_settings
    from retrysafe.stores._url_check import redact_url

    config = load_settings(getattr(settings, SETTING, None))
    store: Any = _open(config)
    kind, where = config.store
    name = store.connector.url if kind == "django" else redact_url(where)
    try:
        keys.main(args=args, prog_name=_PROG, obj=KeyAdminSource(store, name))
    except SystemExit as stop:
        code = stop.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        store.close()


class Command(BaseCommand):
    help = (
        "Inspect and evict the idempotency keys the retrysafe middleware stored: "
        "list, show KEY, evict KEY (see `manage.py retrysafe_keys --help`)."
    )

    def run_from_argv(self, argv: list[str]) -> None:
        # click parses the arguments: the same commands, help and errors as `retrysafe keys`.
        from django.db import connections

        try:
            code = _run(argv[2:])
        finally:
            connections.close_all()
        sys.exit(code)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("keys_args", nargs=argparse.REMAINDER)

    def handle(self, *args: Any, **options: Any) -> None:
        code = _run(list(options.get("keys_args") or args))
        if code:
            raise CommandError(f"retrysafe_keys exited with {code}", returncode=code)
