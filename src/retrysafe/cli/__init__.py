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
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import click

from retrysafe._exceptions import RetrysafeWarning
from retrysafe.cli._common import EXIT_SIGINT, EXIT_USAGE, clip, epilog

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
            with _ctrl_c_after():
                command: click.Command = getattr(importlib.import_module(module), attr)
            return command
        return super().get_command(ctx, cmd_name)

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


@contextlib.contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """Ctrl-C pressed while a command's modules load takes effect after they loaded.

    Python raises ``KeyboardInterrupt`` wherever the main thread is, and in an import that
    can be inside a C extension's set-up (a crash) or an import lock's callback (the
    interrupt swallowed, the command run anyway). Here SIGINT is only recorded while the
    block runs and raised at its end, where click turns it into ``retrysafe: interrupted``,
    exit 130. Left alone when SIGINT is not Python's default handler (ignored in a
    background job, or someone else's) or off the main thread."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


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
    and takes SIGHUP for SIGTERM (:func:`~retrysafe.cli._signals.hang_up_as_sigterm`)."""
    if argv is None:
        from retrysafe._gc import tune_for_serving
        from retrysafe.cli._signals import hang_up_as_sigterm

        tune_for_serving()
        hang_up_as_sigterm()
    return cli.main(args=argv, prog_name="retrysafe")
