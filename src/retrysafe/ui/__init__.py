"""The operator console (``retrysafe ui``): server-rendered pages over a store — the outbox's
jobs and dead letters, webhook endpoints, deliveries and their dead-letter queue, agent runs'
audit logs, and idempotency keys — with the actions an operator takes on them (reconcile and
retry with the same key, purge, webhook replay with the same ``webhook-id``, enable and
disable an endpoint).

Run it with ``retrysafe ui --store URL``, or mount it in your own ASGI app::

    from starlette.routing import Mount
    from retrysafe.stores import open_store
    from retrysafe.ui import console_app

    store = open_store("postgresql://…", create=False)
    routes = [Mount("/retrysafe", console_app(store, token=os.environ["CONSOLE_TOKEN"]))]

Needs ``retrysafe[ui]`` (Starlette and Jinja2). Every asset ships in the package: no CDN, no
build step. See docs/ui.md for the security model (loopback by default, a token beyond it,
CSRF on every action, POST-only actions, an action log).
"""

from retrysafe.ui._app import console_app

__all__ = ["console_app"]
