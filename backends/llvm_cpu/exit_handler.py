"""A native signal handler that writes a fixed message to stderr and exits 1.

Python cannot handle a fault such as SIGBUS (its handlers run between bytecodes, so the faulting
load would repeat for ever); this handler is native code, async-signal-safe (write(2) and _exit(2)
only), JIT-compiled once per process. The runtime (runtime/sigbus.py) fills in the message and
installs it.
"""

from __future__ import annotations

from dataclasses import dataclass

MSG_BYTES = 1024


@dataclass(frozen=True)
class ExitHandler:
    address: int        # void handler(int sig)
    msg: int            # the message buffer, MSG_BYTES bytes
    length: int         # int64: how many of them to write
    _keep: tuple        # the execution engine and target machine that hold the code


def _module(write: int, exit_: int) -> str:
    return f"""
@strata_exit_msg = global [{MSG_BYTES} x i8] zeroinitializer
@strata_exit_len = global i64 0

define void @strata_exit_handler(i32 %sig) {{
  %n = load volatile i64, ptr @strata_exit_len
  %w = inttoptr i64 {write} to ptr
  %r = call i64 %w(i32 2, ptr @strata_exit_msg, i64 %n)
  %e = inttoptr i64 {exit_} to ptr
  call void %e(i32 1)
  unreachable
}}
"""


def compile_exit_handler(write: int, exit_: int) -> ExitHandler:
    """The handler, calling libc's write and _exit at the given addresses."""
    import llvmlite.binding as llvm

    from .jit import optimize
    from .target import Target

    mod, tm = optimize(_module(write, exit_), Target.host())
    ee = llvm.create_mcjit_compiler(mod, tm)
    ee.finalize_object()
    return ExitHandler(address=ee.get_function_address("strata_exit_handler"),
                       msg=ee.get_global_value_address("strata_exit_msg"),
                       length=ee.get_global_value_address("strata_exit_len"), _keep=(ee, tm))
