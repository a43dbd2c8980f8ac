"""The demo's publishing service in a process of its own: ``python -m retrysafe.demo._child``.

Started by :func:`retrysafe.demo.run_demo` through :class:`~retrysafe._serving.ServerProcess`
(internal: the arguments are the runner's). It serves :class:`PublishingService` behind
:class:`~retrysafe.IdempotencyMiddleware` on the SQLite key store ``--keys``, and counts every
post in the effect ledger file ``--ledger``, which the runner reads for its report. With
``--remove-when-orphaned DIR`` it removes that directory (the demo's temporary one) when the
demo was killed outright (SIGKILL, the OOM killer), whose own cleanup then never ran. A service
runs apart from its clients: in one process the service, the proxy and the client would share
one interpreter lock, and the protected pass would pay for the server's work as well as its
own.
"""

from __future__ import annotations

import argparse
import functools
import shutil
from collections.abc import Callable

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m retrysafe.demo._child")
    parser.add_argument("--keys", required=True, help="the SQLite key store's file")
    parser.add_argument("--ledger", required=True, help="the effect ledger's JSONL file")
    parser.add_argument("--lease", type=float, required=True)
    parser.add_argument("--max-body-size", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True, help="the listening socket")
    parser.add_argument("--parent", type=int, required=True, help="exit when it is gone")
    parser.add_argument(
        "--remove-when-orphaned",
        metavar="DIR",
        help="the demo's own temporary directory, removed if the demo is killed outright",
    )
    args = parser.parse_args(argv)

    from retrysafe._gc import tune_for_serving
    from retrysafe._serving import serve_inherited
    from retrysafe.chaos import EffectLedger
    from retrysafe.demo._service import PublishingService
    from retrysafe.server import IdempotencyMiddleware
    from retrysafe.stores import SQLiteStore

    tune_for_serving()
    with SQLiteStore(args.keys) as keys:
        app = IdempotencyMiddleware(
            PublishingService(EffectLedger(args.ledger)),
            store=keys,
            lease=args.lease,
            max_body_size=args.max_body_size,
        )
        serve_inherited(app, args.fd, args.parent, on_orphaned=_remover(args.remove_when_orphaned))


def _remover(directory: str | None) -> Callable[[], None] | None:
    """What removes the demo's temporary directory once the demo is gone, or None."""
    if directory is None:
        return None
    return functools.partial(shutil.rmtree, directory, ignore_errors=True)


if __name__ == "__main__":
    main()
