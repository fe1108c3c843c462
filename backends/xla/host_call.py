"""Host calls inside a jitted GPU program: a native XLA FFI handler that moves a CPU share's
operands and results over the calling stream, so that a split layer costs no jitted call of its own.

Handing a value between a GPU partition and a CPU partition through Python costs a jitted call
per partition, most of it the call's dispatch, and `jax.pure_callback` inside one program costs
JAX's callback machinery per round trip (benchmarks/host_call_bench.py). A `HostCall` is instead
an XLA FFI target (`jax.ffi.ffi_call`) whose handler is JIT-compiled from LLVM IR (the call
frame's decoding in host_call.ll, the copies generated per call site). When the GPU program
reaches it, the handler, on XLA's thread:

1. copies each operand (a device buffer) into its fixed host buffer with ``cudaMemcpyAsync`` on
   the program's own stream, then ``cudaStreamSynchronize``: the copies see every earlier kernel
   of the program and nothing else;
2. calls ``work(arg, stream)``, a native function (a CPU share, native_work.ll, or a ctypes
   callback into Python, which takes the GIL itself); copies the work queues on `stream` land
   before the program's next kernels;
3. queues the copies of the host result buffers into the result buffers on the same stream, so
   the program's next kernels see them; from pageable memory the call stages the data before it
   returns, so the host buffers may be rewritten by the next call.

On JAX's CPU platform (CI) the same handler runs with ``memcpy`` in place of the CUDA calls and no
stream, so the call-frame decoding and the data path are tested without a GPU.
"""

from __future__ import annotations

import ctypes
import itertools
import string
import weakref
from pathlib import Path

import numpy as np

__all__ = ["HostCall", "WORK_CFUNC", "available"]

#: ctypes prototype of a work function: ``void work(int64_t arg, void* stream)`` (the program's CUDA
#: stream, on which the work may queue copies of its own; NULL on the CPU platform).
WORK_CFUNC = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)

_IDS = itertools.count()
_KEEP: list = []            # handlers, engines and callbacks live as long as the process (XLA keeps the targets)
_FRAME_IR = Path(__file__).with_name("host_call.ll").read_text(encoding="utf-8")
_WORK_IR = string.Template(Path(__file__).with_name("native_work.ll").read_text(encoding="utf-8"))


def _handler_ir(name: str, ins: list[tuple[int, int]], outs: list[tuple[int, int]], work: int, arg: int,
                memcpy: int | None, sync: int | None, skip_in: int = 0, wake: int = 0) -> str:
    """IR of handler `name`: operand skip_in + i into host buffer ins[i] = (address, bytes),
    work(arg, stream), host buffer outs[j] (same form) into result j (operands before skip_in
    and results after the last of outs are ordering tokens: never copied). memcpy/sync:
    addresses of cudaMemcpyAsync / cudaStreamSynchronize, or None for the host stand-ins (JAX's
    CPU platform). wake: address of a `void wake(void)` called first, before the copies and the
    wait for the stream (the CPU thread pool's: its workers wake while the GPU finishes the
    call's operands), or 0."""
    gpu = memcpy is not None
    cp = f"inttoptr (i64 {memcpy} to ptr)" if gpu else "@host_memcpy"
    sy = f"inttoptr (i64 {sync} to ptr)" if gpu else "@host_sync"
    L = [_FRAME_IR, f"define ptr @{name}(ptr %frame) {{", "entry:",
         "  %execute = call i1 @hc_execute(ptr %frame)",
         "  br i1 %execute, label %run, label %done",
         "run:"]
    if wake:
        L.append(f"  call void inttoptr (i64 {wake} to ptr)()")
    L += [f"  %stream = call ptr @hc_stream(ptr %frame, i1 {'true' if gpu else 'false'})",
          "  %args = call ptr @hc_buffers(ptr %frame, i1 false)",
          "  %rets = call ptr @hc_buffers(ptr %frame, i1 true)"]
    for i, (addr, n) in enumerate(ins):
        L += [f"  %a{i} = call ptr @hc_data(ptr %args, i64 {i + skip_in})",
              f"  %c{i} = call i32 {cp}(ptr inttoptr (i64 {addr} to ptr), ptr %a{i}, i64 {n}, i32 2, ptr %stream)"]
    if ins:
        L.append(f"  %synced = call i32 {sy}(ptr %stream)")
    L.append(f"  call void inttoptr (i64 {work} to ptr)(i64 {arg}, ptr %stream)")
    for j, (addr, n) in enumerate(outs):
        L += [f"  %r{j} = call ptr @hc_data(ptr %rets, i64 {j})",
              f"  %o{j} = call i32 {cp}(ptr %r{j}, ptr inttoptr (i64 {addr} to ptr), i64 {n}, i32 1, ptr %stream)"]
    L += ["  br label %done", "done:", "  ret ptr null", "}"]
    return "\n".join(L)


def available(platform: str) -> bool:
    """Whether host calls work in programs for `platform` ("gpu" needs libcudart; "cpu" always)."""
    if platform == "cpu":
        return True
    from . import cuda_rt

    return platform == "gpu" and cuda_rt.available()


class HostCall:
    """One host call site: fixed host buffers for the operands (`ins`) and results (`outs`), and the
    native `work(arg)` that turns the one into the other. `__call__(*operands, after=None)` inside a
    jitted function (on `platform`'s device) returns the results as arrays of the device, then an
    ordering token (f32[1], never written).

    The call declares no side effect (a side-effecting call would take JAX's dispatch off its C++
    fast path). So XLA may drop a call whose results nothing
    reads and may reorder calls that do not depend on each other: a caller whose host calls share
    state (the CPU partitions of one step) chains them, each `after=` the previous one's token, and
    makes the program return the last token."""

    def __init__(self, ins: list[np.ndarray], outs: list[np.ndarray], work_addr: int, arg: int = 0,
                 platform: str = "gpu", after: bool = False, wake: int = 0) -> None:
        """after: the call takes an ordering token (another call's) before its operands; wake:
        address of a `void wake(void)` the handler calls on entry (ThreadPool.wake_address), or 0."""
        import jax
        import llvmlite.binding as llvm

        from strata_compiler.backends.llvm_cpu.jit import optimize
        from strata_compiler.backends.llvm_cpu.target import Target

        for a in (*ins, *outs):
            if not a.flags.c_contiguous:
                raise ValueError("host call buffers must be C-contiguous")
        self.ins, self.outs = list(ins), list(outs)
        self.platform = platform
        if platform == "gpu":
            from . import cuda_rt

            L = cuda_rt.lib()
            if L is None:
                raise RuntimeError("host calls on a GPU need libcudart")
            memcpy = ctypes.cast(L.cudaMemcpyAsync, ctypes.c_void_p).value
            sync = ctypes.cast(L.cudaStreamSynchronize, ctypes.c_void_p).value
            xla_platform = "CUDA"
        else:
            memcpy = sync = None
            xla_platform = "cpu"
        self.name = f"strata_host_call_{next(_IDS)}"
        self.after = after
        ir = _handler_ir(self.name, [(a.ctypes.data, a.nbytes) for a in ins], [(a.ctypes.data, a.nbytes) for a in outs],
                         int(work_addr), int(arg), memcpy, sync, skip_in=int(after), wake=int(wake))
        mod, tm = optimize(ir, Target.host())
        ee = llvm.create_mcjit_compiler(mod, tm)
        ee.finalize_object()
        addr = self.address = ee.get_function_address(self.name)     # the handler
        _KEEP.append((ee, tm, self.ins, self.outs))
        jax.ffi.register_ffi_target(self.name, jax.ffi.pycapsule(addr), platform=xla_platform)
        self._call = jax.ffi.ffi_call(self.name, [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
                                      + [jax.ShapeDtypeStruct((1,), np.float32)])

    def __call__(self, *operands, after=None):
        if len(operands) != len(self.ins):
            raise TypeError(f"{self.name}: {len(self.ins)} operands expected, got {len(operands)}")
        if (after is not None) != self.after:
            raise TypeError(f"{self.name}: made with after={self.after}, called with after={after is not None}")
        for x, h in zip(operands, self.ins):
            if tuple(x.shape) != h.shape or np.dtype(x.dtype) != h.dtype:
                raise TypeError(f"{self.name}: operand {x.shape} {x.dtype} does not match its host buffer "
                                f"{h.shape} {h.dtype}")
        return self._call(*(((after,) if self.after else ()) + operands))


def native_work(run_program: int, prog: int, n: int, maxc: int, flag: int, fallback: int,
                timeline: int = 0, tag: int = 0, before: int = 0, traced: tuple[int, int] = (0, 0)) -> int:
    """A work function that runs a CPU partition's segment program without Python
    (native_work.ll): while the int64 at `flag` is 0, ``before()`` when given (pool.py
    `strata_async_wait`: the part of the partition a runner thread computes), then
    ``run_program(prog, n, *maxc)`` (pool.py `strata_run_program`, or `strata_async_start` to hand
    it to the runner; `maxc` points at the chunk count the pool would cut); while it is 2, the same
    with `traced` = (program, n) in its place (time stamps between its ops, for traces);
    otherwise the work function at `fallback` (the Python one). With `timeline` (an int64
    buffer: [on, count, capacity, then (tag, TSC at entry, TSC at exit) per call]) and its first
    word set, each call appends its record. Returns its address (kept alive with the process)."""
    import llvmlite.binding as llvm

    from strata_compiler.backends.llvm_cpu.jit import optimize
    from strata_compiler.backends.llvm_cpu.target import Target

    name = f"strata_native_work_{next(_IDS)}"
    ir = _WORK_IR.substitute(name=name, flag=flag, prog=prog, n=n, traced=traced[0], traced_n=traced[1],
                             fallback=fallback, maxc=maxc, before=before, run_program=run_program,
                             timeline=timeline, tag=tag)
    mod, tm = optimize(ir, Target.host())
    ee = llvm.create_mcjit_compiler(mod, tm)
    ee.finalize_object()
    _KEEP.append((ee, tm))
    return ee.get_function_address(name)


def python_work(fn, weak: bool = False) -> tuple[int, object]:
    """A work function that calls the Python callable fn(stream) (the program's CUDA stream as an
    int, None on the CPU platform; the ctypes callback takes the GIL); returns (address,
    keep-alive object). weak: the callback holds fn by a weak reference (the caller keeps it, and
    with it whatever fn reaches; the programs that call the handler go with the caller)."""
    if weak:
        ref = weakref.ref(fn)

        def call(stream) -> None:
            f = ref()
            if f is not None:
                f(stream)
        cb = WORK_CFUNC(lambda _arg, stream: call(stream))
    else:
        cb = WORK_CFUNC(lambda _arg, stream: fn(stream))
    _KEEP.append(cb)
    return ctypes.cast(cb, ctypes.c_void_p).value, cb
