"""Structured log lines: one JSON object per line, for the gateway, the worker and the proxy.

retrysafe's modules log with ``logging`` and put their fields in ``extra={...}``; this
formatter turns every record into ``{"ts": …, "level": …, "logger": …, "msg": …, <fields>}``.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

__all__ = [
    "JSONFormatter",
    "ShutdownCancels",
    "configure_json_logging",
    "logging_config",
    "quiet_shutdown_cancels",
]

# Attributes every LogRecord has; everything else came from ``extra``.
_STANDARD = frozenset(
    logging.LogRecord("x", 0, "x", 0, "x", None, None).__dict__.keys()
    | {"message", "asctime", "taskName", "color_message"}  # uvicorn's ANSI copy of msg
)


class JSONFormatter(logging.Formatter):
    """Formats a record as one JSON line with its ``extra`` fields at top level."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name, value in record.__dict__.items():
            if name not in _STANDARD and not name.startswith("_"):
                doc[name] = value
        if record.exc_info and record.exc_info[0] is not None:
            # The exception's type and whole message; no traceback: a line per event stays
            # one line an operator can read (a shutdown cancelling requests is not a crash).
            exc = record.exc_info[1]
            doc["error"] = (
                f"{type(exc).__name__}: {exc}" if exc is not None else str(record.exc_info[0])
            )

        return json.dumps(doc, default=str, separators=(",", ":"))


class ShutdownCancels(logging.Filter):
    """uvicorn's error lines about what its own shutdown cancelled, said as what they are.

    When a server's shutdown grace runs out (or a second signal cuts it short), uvicorn
    cancels the requests still running and logs each at ERROR as "Exception in ASGI
    application", with a traceback of the ``CancelledError`` it caused; stopping its
    lifespan task the same way logs "Exception in 'lifespan' protocol". Neither is a fault of
    the application, and an operator's alert on ERROR fired on every deploy that met a slow
    request. This filter makes the request's line a WARNING ("request cancelled by the
    server's shutdown", the error kept), makes "Cancel N running task(s), timeout graceful
    shutdown exceeded" a WARNING, and drops the lifespan's. Any other record, and these
    messages with any other exception, pass unchanged. (The idempotency middleware logs the
    cancelled request's own decision, ``outcome-unknown``: its key stays claimed.)
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "uvicorn.error" or record.levelno != logging.ERROR:
            return True
        msg = record.msg if isinstance(record.msg, str) else ""
        if msg.startswith("Cancel %s running task(s)"):
            _as_warning(record)
            return True
        asyncio = sys.modules.get("asyncio")  # not loaded: nothing was cancelled
        exc = record.exc_info[1] if record.exc_info else None
        if asyncio is None or not isinstance(exc, asyncio.CancelledError):
            return True
        if msg.startswith("Exception in 'lifespan' protocol"):
            return False
        if msg.startswith("Exception in ASGI application"):
            record.msg, record.args = "request cancelled by the server's shutdown", None
            _as_warning(record)
        return True


def _as_warning(record: logging.LogRecord) -> None:
    record.levelno, record.levelname = logging.WARNING, "WARNING"


def quiet_shutdown_cancels() -> None:
    """Put :class:`ShutdownCancels` on uvicorn's error logger, once (a served command's)."""
    log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, ShutdownCancels) for f in log.filters):
        log.addFilter(ShutdownCancels())


def configure_json_logging(
    level: int = logging.INFO, *, stream: TextIO | None = None, logger: str = "retrysafe"
) -> logging.Handler:
    """Send ``logger`` (default: all of retrysafe) to ``stream`` (stderr) as JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JSONFormatter())
    log = logging.getLogger(logger)
    log.handlers = [h for h in log.handlers if not getattr(h, "_retrysafe_json", False)]
    handler._retrysafe_json = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False
    return handler


#: The loggers each server logs on (uvicorn's "uvicorn" covers "uvicorn.error").
_SERVER_LOGGERS = {
    "uvicorn": ("uvicorn", "uvicorn.access"),
    "gunicorn": ("gunicorn.error", "gunicorn.access"),
}


def logging_config(
    level: str = "INFO", *, servers: Sequence[str] = ("uvicorn", "gunicorn")
) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` dictionary that prints retrysafe's lines (the
    middleware's decision per request, the worker's attempts, warnings) as JSON on stderr at
    ``level``, and the loggers of the ``servers`` named (uvicorn's and gunicorn's error and
    access logs) as JSON lines too, at INFO; any other logger's warnings and errors reach the
    root logger, which prints them as JSON lines too.

    Use it as ``uvicorn.run(app, log_config=retrysafe.logging_config())``, gunicorn's
    ``logconfig_dict``, or write it to a file for ``--log-config`` (``examples/logging.json``
    is this dictionary).

    Raises:
        ConfigurationError: ``level`` is not a logging level name.
    """
    from retrysafe._exceptions import ConfigurationError

    name = str(level).upper()
    if name not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigurationError(
            f"level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, not {level!r}",
            option="level",
        )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"retrysafe_json": {"()": "retrysafe._logging.JSONFormatter"}},
        "filters": {"retrysafe_shutdown": {"()": "retrysafe._logging.ShutdownCancels"}},
        "handlers": {
            "retrysafe_stderr": {
                "class": "logging.StreamHandler",
                "formatter": "retrysafe_json",
                "filters": ["retrysafe_shutdown"],
                "stream": "ext://sys.stderr",
            }
        },
        # A root of its own: gunicorn merges this dictionary into its defaults key by key,
        # and its root logger's handler would be gone.
        "root": {"handlers": ["retrysafe_stderr"], "level": "WARNING"},
        "loggers": {
            "retrysafe": {"handlers": ["retrysafe_stderr"], "level": name, "propagate": False},
            **{
                logger: {"handlers": ["retrysafe_stderr"], "level": "INFO", "propagate": False}
                for server in servers
                for logger in _SERVER_LOGGERS.get(server, (server,))
            },
        },
    }


def logging_snapshot(*names: str) -> Callable[[], None]:
    """A function that puts the loggers ``names`` back as they are now (handlers, level,
    propagation): a command that configures logging for its run restores it when it ends, so
    an embedding process (a test runner, an application calling the CLI) keeps its own."""
    saved = [
        (logger, list(logger.handlers), logger.level, logger.propagate)
        for logger in (logging.getLogger(name) for name in names)
    ]

    def restore() -> None:
        for logger, handlers, level, propagate in saved:
            logger.handlers = handlers
            logger.setLevel(level)
            logger.propagate = propagate

    return restore
