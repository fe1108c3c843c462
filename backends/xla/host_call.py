"""Host calls inside a jitted GPU program: a native XLA FFI handler that moves a CPU share's
operands and results over the calling stream, so that a split layer costs no jitted call of its own.

The mixed runtime's hand-off between a GPU partition and a CPU partition goes through Python: a
jitted call per partition, a raw copy out, the CPU kernels, a staging copy back in. On an H200
host that is ~400 us per split layer (BENCHMARKS.md, "Where a split layer's time goes"), most of
it the jitted call's dispatch. `jax.pure_callback` inside one jitted program measured ~190 us per
round trip there (`benchmarks/host_call_bench.py`): JAX's callback machinery, not the copies.

A `HostCall` is an XLA FFI target (`jax.ffi.ffi_call`) whose handler is JIT-compiled from LLVM IR.
When the GPU program reaches it, the handler, on XLA's thread:

1. copies each operand (a device buffer) into its fixed host buffer with ``cudaMemcpyAsync`` on
   the program's own stream, then ``cudaStreamSynchronize``: the copies see every earlier kernel
   of the program and nothing else;
2. calls ``work(arg, stream)``, a native function (a CPU share, or a ctypes callback into Python,
   which takes the GIL itself); copies the work queues on `stream` land before the program's
   next kernels (the expert cache's in-step prefetch);
3. queues the copies of the host result buffers into the result buffers on the same stream, so
   the program's next kernels see them; from pageable memory the call stages the data before it
   returns, so the host buffers may be rewritten by the next call.

On JAX's CPU platform (CI) the same handler runs with ``memcpy`` in place of the CUDA calls and no
stream, so the call-frame decoding and the data path are tested without a GPU.

The call frame is read at the byte offsets of XLA's C API (xla/ffi/api/c_api.h, which grows only
at the end of its structs): XLA_FFI_CallFrame {size, ext, api, ctx, stage, args, rets, attrs,
future}, XLA_FFI_Args / XLA_FFI_Rets {size, ext, n, types, ptrs}, XLA_FFI_Buffer {size, ext, dtype,
data, rank, dims}, and XLA_FFI_Api's XLA_FFI_Stream_Get at offset 80. The handler answers XLA's
metadata query (the call with a metadata extension) with the API version the runtime reports and
no traits: a host call syncs its stream, so it may not be captured into a CUDA graph.
"""

from __future__ import annotations

import ctypes
import itertools
import weakref

import numpy as np

__all__ = ["HostCall", "WORK_CFUNC", "available"]

#: ctypes prototype of a work function: ``void work(int64_t arg, void* stream)`` (the program's CUDA
#: stream, on which the work may queue copies of its own; NULL on the CPU platform).
WORK_CFUNC = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p)

_IDS = itertools.count()
_KEEP: list = []            # handlers, engines and callbacks live as long as the process (XLA keeps the targets)

# byte offsets in XLA's C API structs (64-bit)
_FRAME_EXT, _FRAME_API, _FRAME_CTX, _FRAME_STAGE = 8, 16, 24, 32
_FRAME_ARGS_N, _FRAME_ARGS_PTRS = 56, 72
_FRAME_RETS_N, _FRAME_RETS_PTRS = 96, 112
_BUF_DATA = 24
_API_VERSION_MAJOR, _API_VERSION_MINOR = 32, 36
_API_STREAM_GET = 80
_EXT_TYPE, _EXT_METADATA = 8, 24
_META_MAJOR, _META_MINOR, _META_TRAITS = 24, 28, 32
_STAGE_EXECUTE = 3
_EXT_TYPE_METADATA = 1

_HOST_HELPERS = """
define void @host_memcpy(ptr %dst, ptr %src, i64 %n, i32 %kind, ptr %stream) {
  call void @llvm.memcpy.p0.p0.i64(ptr %dst, ptr %src, i64 %n, i1 false)
  ret void
}
define i32 @host_sync(ptr %stream) {
  ret i32 0
}
declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)
"""


def _handler_ir(name: str, ins: list[tuple], outs: list[tuple], work: int, arg: int,
                memcpy: int | None, sync: int | None, skip_in: int = 0, wake: int = 0) -> str:
    """IR of handler `name`: operand skip_in + i into host buffer ins[i] = (address, bytes,
    staging address or 0), work(arg, stream), host buffer outs[j] (same form) into result j
    (operands before skip_in and results after the last of outs are ordering tokens: never
    copied). With a staging address the device copy goes through that (page-locked) buffer and a
    host memcpy: DMA straight from and to it, where pageable memory costs the driver a bounce
    copy. memcpy/sync: addresses of cudaMemcpyAsync / cudaStreamSynchronize, or None for the host
    stand-ins (JAX's CPU platform). wake: address of a `void wake(void)` called first, before the
    copies and the wait for the stream (the CPU thread pool's: its workers wake while the GPU
    finishes the call's operands), or 0."""
    wake_call = f"\n  call void inttoptr (i64 {wake} to ptr)()" if wake else ""
    L = []
    if memcpy is None:
        L.append(_HOST_HELPERS)
        cp, sy = "@host_memcpy", "@host_sync"
    else:
        L.append("declare void @llvm.memcpy.p0.p0.i64(ptr, ptr, i64, i1)")
        cp = f"inttoptr (i64 {memcpy} to ptr)"
        sy = f"inttoptr (i64 {sync} to ptr)"
    L.append(f"""
define ptr @{name}(ptr %frame) {{
entry:
  %extp = getelementptr i8, ptr %frame, i64 {_FRAME_EXT}
  %ext = load ptr, ptr %extp
  %hasext = icmp ne ptr %ext, null
  br i1 %hasext, label %meta, label %stagechk
meta:
  %tyP = getelementptr i8, ptr %ext, i64 {_EXT_TYPE}
  %ty = load i32, ptr %tyP
  %ismeta = icmp eq i32 %ty, {_EXT_TYPE_METADATA}
  br i1 %ismeta, label %fill, label %done
fill:
  %mdP = getelementptr i8, ptr %ext, i64 {_EXT_METADATA}
  %md = load ptr, ptr %mdP
  %apiP0 = getelementptr i8, ptr %frame, i64 {_FRAME_API}
  %api0 = load ptr, ptr %apiP0
  %majP = getelementptr i8, ptr %api0, i64 {_API_VERSION_MAJOR}
  %minP = getelementptr i8, ptr %api0, i64 {_API_VERSION_MINOR}
  %maj = load i32, ptr %majP
  %min = load i32, ptr %minP
  %mmajP = getelementptr i8, ptr %md, i64 {_META_MAJOR}
  %mminP = getelementptr i8, ptr %md, i64 {_META_MINOR}
  %mtrP = getelementptr i8, ptr %md, i64 {_META_TRAITS}
  store i32 %maj, ptr %mmajP
  store i32 %min, ptr %mminP
  store i32 0, ptr %mtrP
  br label %done
stagechk:
  %stP = getelementptr i8, ptr %frame, i64 {_FRAME_STAGE}
  %st = load i32, ptr %stP
  %exec = icmp eq i32 %st, {_STAGE_EXECUTE}
  br i1 %exec, label %run, label %done
run:
  %sargs = alloca [4 x i64], align 8{wake_call}
  %apiP = getelementptr i8, ptr %frame, i64 {_FRAME_API}
  %api = load ptr, ptr %apiP
  %ctxP = getelementptr i8, ptr %frame, i64 {_FRAME_CTX}
  %ctx = load ptr, ptr %ctxP
  store i64 32, ptr %sargs
  %sa1 = getelementptr i64, ptr %sargs, i64 1
  store i64 0, ptr %sa1
  %sa2 = getelementptr i64, ptr %sargs, i64 2
  store ptr %ctx, ptr %sa2
  %sa3 = getelementptr i64, ptr %sargs, i64 3
  store i64 0, ptr %sa3""")
    if memcpy is not None:      # XLA_FFI_Stream_Get(&args): the program's stream into args[3]
        L.append(f"""  %sgP = getelementptr i8, ptr %api, i64 {_API_STREAM_GET}
  %sg = load ptr, ptr %sgP
  %serr = call ptr %sg(ptr %sargs)""")
    L.append(f"""  %stream = load ptr, ptr %sa3
  %argsP = getelementptr i8, ptr %frame, i64 {_FRAME_ARGS_PTRS}
  %args = load ptr, ptr %argsP
  %retsP = getelementptr i8, ptr %frame, i64 {_FRAME_RETS_PTRS}
  %rets = load ptr, ptr %retsP""")
    for i, (addr, n, stg) in enumerate(ins):
        L.append(f"""  %a{i}p = getelementptr ptr, ptr %args, i64 {i + skip_in}
  %a{i} = load ptr, ptr %a{i}p
  %a{i}dp = getelementptr i8, ptr %a{i}, i64 {_BUF_DATA}
  %a{i}d = load ptr, ptr %a{i}dp
  %c{i} = call i32 {cp}(ptr inttoptr (i64 {stg or addr} to ptr), ptr %a{i}d, i64 {n}, i32 2, ptr %stream)""")
    if ins:
        L.append(f"  %synced = call i32 {sy}(ptr %stream)")
    for addr, n, stg in ins:
        if stg:
            L.append(f"  call void @llvm.memcpy.p0.p0.i64(ptr inttoptr (i64 {addr} to ptr), "
                     f"ptr inttoptr (i64 {stg} to ptr), i64 {n}, i1 false)")
    L.append(f"  call void inttoptr (i64 {work} to ptr)(i64 {arg}, ptr %stream)")
    for j, (addr, n, stg) in enumerate(outs):
        if stg:
            L.append(f"  call void @llvm.memcpy.p0.p0.i64(ptr inttoptr (i64 {stg} to ptr), "
                     f"ptr inttoptr (i64 {addr} to ptr), i64 {n}, i1 false)")
        L.append(f"""  %r{j}p = getelementptr ptr, ptr %rets, i64 {j}
  %r{j} = load ptr, ptr %r{j}p
  %r{j}dp = getelementptr i8, ptr %r{j}, i64 {_BUF_DATA}
  %r{j}d = load ptr, ptr %r{j}dp
  %o{j} = call i32 {cp}(ptr %r{j}d, ptr inttoptr (i64 {stg or addr} to ptr), i64 {n}, i32 1, ptr %stream)""")
    L.append("""  br label %done
done:
  ret ptr null
}""")
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
    fast path: ~0.5 ms a step on the CPU platform). So XLA may drop a call whose results nothing
    reads and may reorder calls that do not depend on each other: a caller whose host calls share
    state (the CPU partitions of one step) chains them, each `after=` the previous one's token, and
    makes the program return the last token."""

    def __init__(self, ins: list[np.ndarray], outs: list[np.ndarray], work_addr: int, arg: int = 0,
                 platform: str = "gpu", after: bool = False, staging: bool = False, wake: int = 0) -> None:
        """after: the call takes an ordering token (another call's) before its operands;
        staging: copies go through staging buffers of their own (on a GPU page-locked; on the CPU
        platform, for tests of that path, plain memory); wake: address of a `void wake(void)` the
        handler calls on entry (ThreadPool.wake_address), or 0."""
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
            L.cudaStreamSynchronize.restype = ctypes.c_int
            memcpy = ctypes.cast(L.cudaMemcpyAsync, ctypes.c_void_p).value
            sync = ctypes.cast(L.cudaStreamSynchronize, ctypes.c_void_p).value
            xla_platform = "CUDA"
        else:
            memcpy = sync = None
            xla_platform = "cpu"
        self.name = f"strata_host_call_{next(_IDS)}"
        self.after = after
        # on a GPU, page-locked staging for every buffer (one block, never freed: see _handler_ir)
        stage = [0] * (len(ins) + len(outs))
        if staging:
            sizes = [-(-a.nbytes // 64) * 64 for a in (*ins, *outs)]
            if platform == "gpu":
                try:
                    base = cuda_rt.host_alloc(max(1, sum(sizes)))
                except RuntimeError:     # no page-locked memory to spare: copy straight, via the driver's
                    base = 0
            else:
                block = np.zeros(max(1, sum(sizes)) + 64, np.uint8)
                _KEEP.append(block)
                base = -(-block.ctypes.data // 64) * 64
            if base:
                stage = [base + off for off in np.cumsum([0] + sizes[:-1]).tolist()] if sizes else []
        ir = _handler_ir(self.name, [(a.ctypes.data, a.nbytes, st) for a, st in zip(ins, stage)],
                         [(a.ctypes.data, a.nbytes, st) for a, st in zip(outs, stage[len(ins):])],
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
                timeline: int = 0, tag: int = 0, before: int = 0, traced: tuple[int, int] = (0, 0),
                after: int = 0, wait_event: tuple[int, int] = (0, 0)) -> int:
    """A work function that runs a CPU partition's segment program without Python: while the
    int64 at `flag` is 0, ``before()`` when given (pool.py `strata_async_wait`: the part of the
    partition a runner thread computes), then ``run_program(prog, n, *maxc)`` (pool.py
    `strata_run_program`, or `strata_async_start` to hand it to the runner; `maxc` points at the
    chunk count the pool would cut); while it is 2, the same with `traced` = (program, n) in its
    place (the program with time stamps between its ops, for traces); otherwise the work
    function at `fallback` (the Python one: the MoE phase timer, disk tiers). With `timeline` (an
    int64 buffer: [on, count, capacity, then (tag, TSC at entry, TSC at exit) per call]) and its
    first word set, each call appends its record. With `after`, ``after(stream)`` runs once the
    program has (runtime/native_prefetch.py: the expert cache's prefetch). With `wait_event` =
    (cudaStreamWaitEvent, event), the program's stream first waits for the event (the prefetch's
    copies on their own stream). Returns its address (kept alive with the process)."""
    import llvmlite.binding as llvm

    from strata_compiler.backends.llvm_cpu.jit import optimize
    from strata_compiler.backends.llvm_cpu.target import Target

    name = f"strata_native_work_{next(_IDS)}"
    ir = f"""
define void @{name}(i64 %arg, ptr %stream) {{
entry:
  %f = load volatile i64, ptr inttoptr (i64 {flag} to ptr), align 8
  %tr = icmp eq i64 %f, 2
  %trok = and i1 %tr, {"true" if traced[0] else "false"}
  %plain = icmp eq i64 %f, 0
  %go = or i1 %plain, %trok
  %p = select i1 %trok, i64 {traced[0]}, i64 {prog}
  %pn = select i1 %trok, i64 {traced[1]}, i64 {n}
  br i1 %go, label %native, label %python
python:
  call void inttoptr (i64 {fallback} to ptr)(i64 %arg, ptr %stream)
  ret void
native:{f"{chr(10)}  %we = call i32 inttoptr (i64 {wait_event[0]} to ptr)(ptr %stream, ptr inttoptr (i64 {wait_event[1]} to ptr), i32 0)" if wait_event[0] else ""}
  %m = load volatile i64, ptr inttoptr (i64 {maxc} to ptr), align 8
  %t0 = call i64 @llvm.readcyclecounter(){f"{chr(10)}  call void inttoptr (i64 {before} to ptr)()" if before else ""}
  %pp = inttoptr i64 %p to ptr
  call void inttoptr (i64 {run_program} to ptr)(ptr %pp, i64 %pn, i64 %m){f"{chr(10)}  call void inttoptr (i64 {after} to ptr)(ptr %stream)" if after else ""}
  %t1 = call i64 @llvm.readcyclecounter()
  br i1 {"true" if timeline else "false"}, label %tl, label %done
tl:
  %tlp = inttoptr i64 {timeline or 0} to ptr
  %on = load volatile i64, ptr %tlp, align 8
  %rec = icmp ne i64 %on, 0
  br i1 %rec, label %add, label %done
add:
  %cp = getelementptr i64, ptr %tlp, i64 1
  %capp = getelementptr i64, ptr %tlp, i64 2
  %i = atomicrmw add ptr %cp, i64 1 seq_cst, align 8
  %cap = load i64, ptr %capp, align 8
  %fits = icmp slt i64 %i, %cap
  br i1 %fits, label %store, label %done
store:
  %o = mul i64 %i, 3
  %o3 = add i64 %o, 3
  %e0 = getelementptr i64, ptr %tlp, i64 %o3
  store i64 {tag}, ptr %e0, align 8
  %e1 = getelementptr i64, ptr %e0, i64 1
  store i64 %t0, ptr %e1, align 8
  %e2 = getelementptr i64, ptr %e0, i64 2
  store i64 %t1, ptr %e2, align 8
  br label %done
done:
  ret void
}}
declare i64 @llvm.readcyclecounter()
"""
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
