"""A weights file that shrinks under a running process: one `error:` line and exit 1, not a crash.

The plan's weights are read through a memory map; when the file is truncated (or replaced in place)
while a process runs, reading a page past its new end raises SIGBUS, which Python cannot handle:
its handlers run between bytecodes, so the faulting load would repeat forever, and without one the
process dies with "Bus error" and no word about the file. `guard` installs a small native handler
(compiled here with LLVM, async-signal-safe: write(2) and _exit(2) only) that prints a message
naming the file and exits 1. The console commands call it once the plan is loaded; library users
keep their process's own signal handling.
"""

from __future__ import annotations

import ctypes
import signal
from pathlib import Path

_MSG_BYTES = 1024
_state: dict = {}


def _module(write: int, exit_: int) -> str:
    return f"""
@strata_sigbus_msg = global [{_MSG_BYTES} x i8] zeroinitializer
@strata_sigbus_len = global i64 0

define void @strata_sigbus(i32 %sig) {{
  %n = load volatile i64, ptr @strata_sigbus_len
  %w = inttoptr i64 {write} to ptr
  %r = call i64 %w(i32 2, ptr @strata_sigbus_msg, i64 %n)
  %e = inttoptr i64 {exit_} to ptr
  call void %e(i32 1)
  unreachable
}}
"""


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
    if "address" not in _state:
        import llvmlite.binding as llvm

        from strata_compiler.backends.llvm_cpu.jit import optimize
        from strata_compiler.backends.llvm_cpu.target import Target

        mod, tm = optimize(_module(write, exit_), Target.host())
        ee = llvm.create_mcjit_compiler(mod, tm)
        ee.finalize_object()
        _state.update(engine=(ee, tm), address=ee.get_function_address("strata_sigbus"),
                      msg=ee.get_global_value_address("strata_sigbus_msg"),
                      len=ee.get_global_value_address("strata_sigbus_len"))
    text = (f"error: {weights} changed while this process was reading it (truncated or rewritten in place: "
            f"a read past its end); recompile the plan or restore the file, and do not overwrite a plan "
            f"that is in use\n").encode("utf-8", "replace")[:_MSG_BYTES]
    ctypes.memmove(_state["msg"], text, len(text))
    ctypes.c_int64.from_address(_state["len"]).value = len(text)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(int(signal.SIGBUS), _state["address"])
    return True
