"""The ``retrysafe`` command line. Subcommands load lazily, so ``retrysafe --help`` stays fast
and a subcommand's dependencies are imported only when it runs.

Every command follows one convention (docs/cli.md, :mod:`retrysafe.cli._common`); the group
prints click's usage errors in its one-line form (``retrysafe: error: --limit: …``, exit 2)
and exits 130 when Ctrl-C interrupts a command.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Sequence
from typing import Any, TextIO

import click

from retrysafe._exceptions import RetrysafeWarning
from retrysafe.cli._common import EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE, clip, epilog

__all__ = ["main"]

# name -> "module:attribute" of a click command or group.
_COMMANDS: dict[str, str] = {
    "agents": "retrysafe.cli._agents:agents",
    "chaos": "retrysafe.cli._chaos:chaos",
    "demo": "retrysafe.cli._demo:demo",
    "gateway": "retrysafe.cli._gateway:gateway",
    "dlq": "retrysafe.cli._client:dlq",
    "jobs": "retrysafe.cli._client:jobs",
    "keys": "retrysafe.cli._keys:keys",
    "migrate": "retrysafe.cli._migrate:migrate",
    "proof": "retrysafe.cli._proof:proof",
    "reconcile": "retrysafe.cli._client:reconcile_command",
    "ui": "retrysafe.cli._ui:ui",
    "webhooks": "retrysafe.cli._webhooks:webhooks",
    "worker": "retrysafe.cli._client:worker",
}


# Each command's summary, the first sentence of its help: what ``retrysafe --help`` lists
# without importing the command (the agents and proof commands alone import httpx and more,
# ~0.3 s). tests/cli/test_convention.py checks that each is the command's own.
_SUMMARIES: dict[str, str] = {
    "agents": "Agent runs and their tool calls (the audit log).",
    "chaos": "Fault injection: prove that your client's retries are safe.",
    "demo": "Reproduce the lost-answer incident: naive duplicates next to retrysafe's zero.",
    "gateway": "Run a reverse proxy that gives UPSTREAM idempotency keys.",
    "dlq": "The dead-letter queue: UNKNOWN and REJECTED jobs.",
    "jobs": "Submit, list, inspect, retry and cancel outbox jobs.",
    "keys": (
        "Inspect and evict the idempotency keys the middleware stored (sqlite, postgresql, redis)."
    ),
    "migrate": "Create or upgrade the store's schema and record its version.",
    "proof": "Run the chaos matrix: every scenario with the naive client beside retrysafe.",
    "reconcile": "Re-send UNKNOWN jobs with their same key; the server's replay settles them.",
    "ui": "Serve the operator console: jobs, dead letters, webhooks, agent runs and keys.",
    "webhooks": "Signed webhook delivery (Standard Webhooks): endpoints, send, DLQ, worker.",
    "worker": (
        "Deliver outbox jobs until stopped (SIGTERM: in-flight attempts finish, exit 143;"
        " Ctrl-C: in-flight jobs released, exit 130)."
    ),
}


# click >= 8.2 raises it for a group run without a command (8.1 prints the help and exits 0).
_NO_ARGS_IS_HELP: type[click.UsageError] = getattr(
    click.exceptions, "NoArgsIsHelpError", type("_Never", (click.UsageError,), {})
)


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(_COMMANDS))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _COMMANDS:
            module, _, attr = _COMMANDS[cmd_name].partition(":")
            command: click.Command = getattr(importlib.import_module(module), attr)
            _LOADING.release()  # the command handles signals from here on
            return command
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's list of commands, each summarised from :data:`_SUMMARIES` (a command
        without one is loaded for its help, as click does)."""
        commands: list[tuple[str, click.Command]] = []
        for name in self.list_commands(ctx):
            summary = _SUMMARIES.get(name) if name in _COMMANDS else None
            command = click.Command(name, help=summary) if summary else self.get_command(ctx, name)
            if command is not None and not command.hidden:
                commands.append((name, command))
        if commands:
            limit = formatter.width - 6 - max(len(name) for name, _ in commands)
            with formatter.section("Commands"):
                formatter.write_dl([(n, c.get_short_help_str(limit)) for n, c in commands])

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """click's ``main``, with the convention's error lines and exit codes."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except _NO_ARGS_IS_HELP as exc:  # `retrysafe jobs` alone: the help, as click shows it
            exc.show()
            sys.exit(EXIT_USAGE)
        except click.UsageError as exc:
            _usage_line(exc)
            sys.exit(EXIT_USAGE)
        except click.ClickException as exc:
            click.echo(f"retrysafe: error: {clip(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except OSError as exc:
            if exc.errno not in _CANNOT_WRITE:
                raise
            # The results could not be written (`jobs list >/dev/full`): one line, and what
            # is still buffered for stdout dropped so that exit does not fail again.
            with contextlib.suppress(OSError, ValueError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.close(null)
            click.echo(f"retrysafe: error: cannot write: {exc.strerror or exc}", err=True)
            sys.exit(1)
        except click.Abort as exc:
            if isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt):
                click.echo("retrysafe: interrupted", err=True)
                sys.exit(EXIT_SIGINT)
            click.echo("retrysafe: aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


class _Loading:
    """SIGINT and SIGTERM that arrive while the command line loads (its first tenth of a
    second or so: the interpreter imports click, the command's modules, their C extensions)
    take effect once it has loaded.

    Python raises ``KeyboardInterrupt`` wherever the main thread is, and in an import that
    can be inside a C extension's set-up (a crash) or an import lock's callback (the
    interrupt swallowed, the command run anyway); SIGTERM's default action kills the process
    with no word. Here both are only recorded until :meth:`release` (the command is loaded
    and handles signals itself, or the run ends), which then ends the run as such a signal
    does: Ctrl-C as ``retrysafe: interrupted``, exit 130 (click's ``Abort``); SIGTERM as
    ``retrysafe: stopped by SIGTERM``, exit 143. A signal whose handler is not the default
    (ignored in a background job, someone else's) is left alone, and so is every signal off
    the main thread."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def hold(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, default in (
            (signal.SIGINT, signal.default_int_handler),
            (signal.SIGTERM, signal.SIG_DFL),
        ):
            if signal.getsignal(sig) is default:
                self._previous[sig] = signal.signal(sig, self._record)

    def _record(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def release(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        received, self.received = self.received, []
        if signal.SIGTERM in received:
            click.echo("retrysafe: stopped by SIGTERM", err=True)
            sys.exit(EXIT_SIGTERM)
        if received:
            raise KeyboardInterrupt


_LOADING = _Loading()


#: The errors of a write that cannot be done (a full disk, a quota, an I/O error).
_CANNOT_WRITE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})


def _usage_line(exc: click.UsageError) -> None:
    """``retrysafe: error: --limit: 0 is not in the range x>=1. (see 'retrysafe jobs list
    --help')``: one line naming the option, whatever click's message."""
    if isinstance(exc, click.BadParameter) and not isinstance(exc, click.MissingParameter):
        hint = exc.param_hint
        if isinstance(hint, str):
            name = hint
        elif hint:
            name = " / ".join(hint)
        elif isinstance(exc.param, click.Option):
            name = next((o for o in exc.param.opts if o.startswith("--")), exc.param.opts[0])
        elif exc.param is not None:
            name = exc.param.human_readable_name
        else:
            name = ""
        message = f"{name.strip(chr(39))}: {exc.message}" if name else exc.message
    else:
        message = exc.format_message()
    message = " ".join(clip(message).splitlines())
    if exc.ctx is not None:
        message += f" (see '{exc.ctx.command_path} --help')"
    click.echo(f"retrysafe: error: {message}", err=True)


@click.group(
    cls=_LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=epilog(),
)
@click.version_option(package_name="retrysafe")
def cli() -> None:
    """Make side-effecting calls safe to retry across networks that lose answers."""
    warnings.showwarning = _show_warning


_default_showwarning = warnings.showwarning


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """A :class:`~retrysafe.RetrysafeWarning` is one line for a person, not a source location."""
    if issubclass(category, RetrysafeWarning):
        click.echo(f"retrysafe: warning: {message}", err=True)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> Any:
    """Console entry point. Run as a program (``argv`` None: the process is the command's
    own), it tunes the garbage collector for long-running work (see :mod:`retrysafe._gc`)
    and takes SIGHUP for SIGTERM (:func:`~retrysafe.cli._signals.hang_up_as_sigterm`).
    SIGINT and SIGTERM are held until the command has loaded (:class:`_Loading`)."""
    _LOADING.hold()
    try:
        if argv is None:
            from retrysafe._gc import tune_for_serving
            from retrysafe.cli._signals import hang_up_as_sigterm

            tune_for_serving()
            hang_up_as_sigterm()
        return cli.main(args=argv, prog_name="retrysafe")
    finally:
        _release_quietly()


def _release_quietly() -> None:
    """:meth:`_Loading.release` when the run ended without loading a command (``--help``,
    ``--version``, a usage error): a signal held meanwhile still ends it as 130 or 143."""
    try:
        _LOADING.release()
    except KeyboardInterrupt:
        click.echo("retrysafe: interrupted", err=True)
        sys.exit(EXIT_SIGINT)
