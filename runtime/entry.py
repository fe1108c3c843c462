"""The console scripts' first code: Ctrl-C while Python is still importing the program (NumPy,
click, JAX: up to a second or more) exits at once with one line, not a traceback. Each command's
own handling takes over once it is imported (runtime/cli.py's _CtrlC, uvicorn's)."""

from __future__ import annotations

import os
import signal
import sys


def _interrupted(_sig, _frame) -> None:
    sys.stderr.write("error: interrupted\n")
    sys.stderr.flush()
    os._exit(130)


def _run(module: str) -> None:
    signal.signal(signal.SIGINT, _interrupted)
    import importlib

    main = importlib.import_module(module).main
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()


def strata_run() -> None:
    _run("strata_compiler.runtime.cli")


def strata_server() -> None:
    _run("strata_compiler.runtime.server_cli")


def stratac() -> None:
    _run("strata_compiler.cli")
