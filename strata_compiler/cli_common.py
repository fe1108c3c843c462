"""What both CLIs share: one-line errors, --debug tracebacks, exit codes."""

from __future__ import annotations

import os
import sys

import click

from . import settings
from .errors import StrataError


def run_cli(cmd: click.Command, argv: list[str] | None = None) -> int:
    """Run a click command; user mistakes print one line `error: ...` and exit nonzero.

    `--debug` anywhere on the command line (or the `debug` setting, STRATA_DEBUG=1) shows the
    traceback instead.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        debug = "--debug" in args or settings.get("debug")
    except StrataError as e:        # a bad STRATA_DEBUG value
        click.echo(f"error: {e}", err=True)
        return e.exit_code
    try:
        rv = cmd.main(args=args, prog_name=os.path.basename(sys.argv[0]) or cmd.name, standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except click.exceptions.Abort:      # click's form of a Ctrl-C while it parses the command line
        click.echo("error: interrupted", err=True)
        return 130
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        if debug:
            raise
        hint = f" (see `{e.ctx.command_path} --help`)" if getattr(e, "ctx", None) else ""
        click.echo(f"error: {e.format_message()}{hint}", err=True)
        return 2
    except StrataError as e:
        if debug:
            raise
        click.echo(f"error: {e}", err=True)
        return e.exit_code
    except KeyboardInterrupt:
        click.echo("error: interrupted", err=True)
        return 130


debug_option = settings.option("debug")
