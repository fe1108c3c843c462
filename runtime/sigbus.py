"""A weights file that shrinks under a running process: one `error:` line and exit 1, not a crash.

The plan's weights are read through a memory map; when the file is truncated (or replaced in place)
while a process runs, reading a page past its new end raises SIGBUS, which Python cannot handle:
its handlers run between bytecodes, so the faulting load would repeat forever, and without one the
process dies with "Bus error" and no word about the file. `guard` installs a small native handler
(backends/llvm_cpu/exit_handler.py, async-signal-safe: write(2) and _exit(2) only) that prints a
message naming the file and exits 1. The console commands call it once the plan is loaded; library
users keep their process's own signal handling.
"""

from __future__ import annotations

import ctypes
import signal
from pathlib import Path

_state: dict = {}


def guard(weights: str | Path) -> bool:
    """Make SIGBUS print "error: <weights> changed while this process was reading it ..." and
    exit 1. False (nothing installed) where the platform has no SIGBUS or no libc to call."""
    if not hasattr(signal, "SIGBUS"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        write, exit_ = (ctypes.cast(getattr(libc, f), ctypes.c_void_p).value for f in ("write", "_exit"))
    except (OSError, AttributeError):
        return False
    from strata_compiler.backends.llvm_cpu.exit_handler import MSG_BYTES, compile_exit_handler

    if "handler" not in _state:
        _state["handler"] = compile_exit_handler(write, exit_)
    h = _state["handler"]
    text = (f"error: {weights} changed while this process was reading it (truncated or rewritten in place: "
            f"a read past its end); recompile the plan or restore the file, and do not overwrite a plan "
            f"that is in use\n").encode("utf-8", "replace")[:MSG_BYTES]
    ctypes.memmove(h.msg, text, len(text))
    ctypes.c_int64.from_address(h.length).value = len(text)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(int(signal.SIGBUS), h.address)
    return True
