"""A persistent native thread pool, written in LLVM IR and JIT-compiled, for running kernels on all cores.

Kernels have the uniform C signature ``void kernel(void* args, int64_t begin, int64_t end)``.
``ThreadPool.parallel_for(kernel, args, total, n_chunks)`` splits ``[0, total)`` into ``n_chunks``
contiguous ranges, as equal as possible (the first ``total % n_chunks`` are one longer; empty ranges are
skipped), and runs them on the pool's workers and the calling thread; it returns when all have run. The
call goes through a ctypes ``CFUNCTYPE``, so the GIL is released while the kernel runs, and costs a few
microseconds.

How the native side works (all of it is the LLVM IR in ``pool.ll``, beside this file):

* One job at a time lives in global state: the descriptor (``fn``, ``args``, ``total``), a 64-bit claim
  word ``work = (n_chunks << 32) | next_chunk``, a 32-bit ``done`` counter and a 32-bit ``gen`` counter.
* ``strata_parallel_for`` writes the descriptor, resets ``done``, stores the claim word (release) and bumps
  ``gen`` (seq_cst); then it claims chunks itself and finally waits until ``done == n_chunks`` (acquire).
* Every participant claims chunks with ``atomicrmw add work, 1 acq_rel``. The value it gets back says by
  itself whether the claim is valid (``next_chunk < n_chunks``), so a worker that arrives late, even one
  that saw an older ``gen``, can never run a chunk twice or read a half-written descriptor: a valid
  claim's job cannot be replaced before that chunk's ``done`` increment, and the acquire RMW reads from the
  release sequence of the store that published the job.
* Workers (created once with ``pthread_create``, detached, with asynchronous signals blocked) wait for
  ``gen`` to change: they spin with ``pause`` for ``spin`` TSC ticks, then ``sched_yield()`` until
  ``spin + yield`` ticks, then sleep in ``futex(FUTEX_WAIT_PRIVATE)`` on ``gen``. Sleepers are counted;
  the publisher wakes them (``FUTEX_WAKE_PRIVATE``) only when the count is non-zero. Both sides use
  seq_cst (increment sleepers / load gen vs. increment gen / load sleepers), and the kernel re-checks the
  futex word, so a wakeup cannot be lost. Even if one were, nothing would hang: the caller claims every
  chunk no worker took, and only waits for chunks that a running worker holds.
* The caller waits for ``done`` the same way (spin, then futex on ``done`` with a 2 ms timeout as a
  backstop); the participant that finishes the last chunk wakes it when it is flagged as sleeping.

The pool is process-wide: the native state is global, workers live until the process exits (exit_group
ends them wherever they are) and the JIT'd code is deliberately never freed, so that interpreter shutdown
cannot unmap code a worker is executing. After ``fork()`` the child has no workers; the next
``parallel_for`` in the child starts them again. The pool is not re-entrant: a kernel must not call
``strata_parallel_for``. Exceptions cannot cross native code, so kernels must not fail.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path
from typing import Callable

import llvmlite.binding as llvm

from strata_compiler import settings
from strata_compiler.backends.llvm_cpu.target import Target
from strata_compiler.backends.llvm_cpu.jit import KernelLibrary, object_code

__all__ = ["ThreadPool", "PoolShare", "get_pool", "set_spin", "default_threads", "pool_split", "KERNEL_CFUNC"]

#: ctypes prototype of a kernel: ``void kernel(void* args, int64_t begin, int64_t end)``.
KERNEL_CFUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)

_MAX_CHUNKS = 2**31 - 1
# Idle workers spin this long, then sched_yield until spin + yield, then sleep on a futex; a caller
# waiting for the last chunk spins this long, then sleeps.
_DEFAULT_SPIN_US = 100.0
_DEFAULT_YIELD_US = 1000.0
_DEFAULT_CALLER_SPIN_US = 500.0

# The native code: LLVM IR beside this file. Linux x86-64 numbers in it: SYS_futex = 202;
# FUTEX_WAIT_PRIVATE = 128, FUTEX_WAKE_PRIVATE = 129; SIG_SETMASK = 2.
_POOL_IR = Path(__file__).with_name("pool.ll").read_text(encoding="utf-8")


def pool_split(default: int = 1) -> int:
    """Chunks per thread of a parallel_for: the `pool_split` setting, else `default` (1; plans with
    GPU partitions pass 4, runtime/partitions.py). More chunks than threads let the others take over
    the chunks of a thread the OS has descheduled (GPU runtime threads share the cores in a mixed
    run); each parallel_for then pays more claims."""
    return settings.get("pool_split") or default


def default_threads() -> int:
    """The `num_threads` setting, else the number of CPUs this process may run on."""
    n = settings.get("num_threads")
    if n is not None:
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class _Native:
    """The JIT-compiled pool code; one per process, never freed."""

    def __init__(self) -> None:
        target = Target.host()
        tm = target.machine()
        lib = KernelLibrary(target)
        obj, _ = object_code(_POOL_IR, target, lib.key(_POOL_IR))   # cached on disk like every kernel
        ee = llvm.create_mcjit_compiler(llvm.parse_assembly(""), tm)
        ee.add_object_file(llvm.ObjectFileRef.from_data(obj))
        ee.finalize_object()
        # Workers execute this code until the process dies: never let the engine be disposed, not even
        # while the interpreter tears down module globals at exit.
        for obj in (ee, tm):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
        self._keep = (ee, tm)

        def fn(name: str, restype, *argtypes):
            addr = ee.get_function_address(name)
            if not addr:
                raise RuntimeError(f"pool: JIT symbol {name} not found")
            return ctypes.CFUNCTYPE(restype, *argtypes)(addr)

        i64, i32, vp = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
        self.parallel_for = fn("strata_parallel_for", None, vp, vp, i64, i64)
        self.start = fn("strata_pool_start", i32, i32)
        self.set_spin_ticks = fn("strata_pool_set_spin", None, i64, i64, i64)
        self.wake = fn("strata_pool_wake", None)
        self.wake_address = ee.get_function_address("strata_pool_wake")
        self.after_fork = fn("strata_pool_after_fork", None)
        self.sleepers = fn("strata_pool_sleepers", i32)
        self.started = fn("strata_pool_started", i32)
        self.rdtsc = fn("strata_rdtsc", ctypes.c_uint64)
        self.call = fn("strata_call", None, vp, vp, i64, i64)
        self.run_program = fn("strata_run_program", None, vp, i64, i64)
        self.run_program_address = ee.get_function_address("strata_run_program")
        self.async_start_address = ee.get_function_address("strata_async_start")
        self.async_wait_address = ee.get_function_address("strata_async_wait")
        self.async_after_fork = fn("strata_async_after_fork", None)
        self.ticks_per_us = self._calibrate()
        tk = self.ticks_per_us
        self.set_spin_ticks(int(_DEFAULT_SPIN_US * tk), int(_DEFAULT_YIELD_US * tk), int(_DEFAULT_CALLER_SPIN_US * tk))
        self.workers = 0          # workers alive in this process
        self.lock = threading.Lock()  # one parallel_for at a time, process-wide (the native state is global)

    def _calibrate(self) -> float:
        t0, c0 = time.perf_counter_ns(), self.rdtsc()
        while time.perf_counter_ns() - t0 < 2_000_000:
            pass
        t1, c1 = time.perf_counter_ns(), self.rdtsc()
        return max(1.0, (c1 - c0) / ((t1 - t0) / 1000.0))

    def ensure_workers(self, n: int) -> None:
        if n > self.workers:
            self.workers += int(self.start(n - self.workers))


_native: _Native | None = None
_native_lock = threading.Lock()


def native_runtime() -> _Native:
    global _native
    if _native is None:
        with _native_lock:
            if _native is None:
                _native = _Native()
    return _native


def _after_fork_in_child() -> None:
    # The child has the parent's memory but none of its threads: start workers again on next use.
    global _pool_lock, _native_lock
    _pool_lock = threading.Lock()
    _native_lock = threading.Lock()
    if _native is not None:
        _native.after_fork()
        _native.async_after_fork()
        _native.workers = 0
        _native.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def set_spin(spin_us: float = _DEFAULT_SPIN_US, yield_us: float = _DEFAULT_YIELD_US,
             caller_spin_us: float = _DEFAULT_CALLER_SPIN_US) -> None:
    """How long idle workers spin (``pause``) and then ``sched_yield`` before sleeping on a futex, and
    how long a caller spins waiting for the last chunk before sleeping. Process-wide; a call that
    changes nothing returns at once (executors set theirs at every step)."""
    global _spin_now
    if (spin_us, yield_us, caller_spin_us) == _spin_now:
        return
    nat = native_runtime()
    tk = nat.ticks_per_us
    nat.set_spin_ticks(int(spin_us * tk), int(yield_us * tk), int(caller_spin_us * tk))
    _spin_now = (spin_us, yield_us, caller_spin_us)


_spin_now = (_DEFAULT_SPIN_US, _DEFAULT_YIELD_US, _DEFAULT_CALLER_SPIN_US)   # what the native side has


class ThreadPool:
    """Runs kernels over chunks of an index range on ``n_threads`` threads (the caller plus workers)."""

    def __init__(self, n_threads: int | None = None) -> None:
        n = default_threads() if n_threads is None else int(n_threads)
        if n < 1:
            raise ValueError(f"ThreadPool: n_threads must be >= 1, got {n_threads}")
        self.n_threads = n
        self.split = pool_split()
        self._want_workers = n - 1
        self._nat = native_runtime()
        with self._nat.lock:
            self._nat.ensure_workers(n - 1)

    @property
    def wake_address(self) -> int:
        """Address of the native ``void strata_pool_wake(void)``: wakes the workers without a job, so
        that the next parallel_for finds them spinning (a host call's handler calls it before it waits
        for its operands). It writes no job state: safe from any thread at any time."""
        return int(self._nat.wake_address)

    def wake(self) -> None:
        """strata_pool_wake() from Python."""
        self._nat.wake()

    @property
    def workers_sleeping(self) -> int:
        """Workers (process-wide) now asleep on the futex."""
        return int(self._nat.sleepers())

    def run(self, kernel_addr: int, args_addr: int, begin: int, end: int) -> None:
        """Call the kernel once, on the calling thread, for ``[begin, end)`` (GIL released)."""
        self._nat.call(kernel_addr, args_addr, begin, end)

    def parallel_for(self, kernel_addr: int, args_addr: int, total: int, n_chunks: int | None = None,
                     *, min_chunk: int = 1) -> None:
        """Run ``kernel(args, begin, end)`` over ``[0, total)`` split in ``n_chunks`` contiguous ranges
        (default ``n_threads`` times ``split``, the chunks per thread; never more than
        ``ceil(total / min_chunk)``) and return when all are done. With one chunk, the kernel is
        called directly on the calling thread. Addresses are Python ints (``ctypes.addressof``,
        ``ExecutionEngine.get_function_address``). Not re-entrant: a kernel must not call back into
        the pool."""
        if total <= 0:
            return
        chunks = self.n_threads * self.split if n_chunks is None else n_chunks
        if chunks > total:
            chunks = total
        if min_chunk > 1:
            chunks = min(chunks, -(-total // min_chunk))
        if chunks < 1:
            raise ValueError(f"parallel_for: n_chunks must be >= 1, got {n_chunks}")
        nat = self._nat
        if chunks == 1:
            nat.call(kernel_addr, args_addr, 0, total)
            return
        if chunks > _MAX_CHUNKS:
            raise ValueError(f"parallel_for: at most {_MAX_CHUNKS} chunks, got {chunks}")
        if nat.workers < self._want_workers:      # after fork(), in the child
            with nat.lock:
                nat.ensure_workers(self._want_workers)
        with nat.lock:
            nat.parallel_for(kernel_addr, args_addr, total, chunks)

    @property
    def run_program_address(self) -> int:
        """Address of ``void strata_run_program(i64* prog, i64 n, i64 max_chunks)``, for native callers
        (a fused step's host call: backends/xla/host_call.py native_work). They bypass the pool's
        Python lock: only where no other thread can start pool work meanwhile."""
        return int(self._nat.run_program_address)

    @property
    def async_addresses(self) -> tuple[int, int]:
        """Addresses of ``strata_async_start(prog, n, max_chunks)`` and ``strata_async_wait()``: a
        segment program run by the pool's runner thread while the poster returns (a fused step's
        host calls around a layer's GPU expert share). Starts and waits alternate; no other pool
        job may be published in between."""
        return int(self._nat.async_start_address), int(self._nat.async_wait_address)

    def run_async(self, prog_addr: int, n: int, split: int | None = None) -> Callable[[], None]:
        """strata_async_start from Python; returns the wait (tests)."""
        start = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)(self.async_addresses[0])
        wait = ctypes.CFUNCTYPE(None)(self.async_addresses[1])
        start(prog_addr, n, self.n_threads * (self.split if split is None else split))
        return wait

    def run_program(self, prog_addr: int, n: int, split: int | None = None) -> None:
        """Run a segment program of n instructions at prog_addr (``strata_run_program`` in the pool's
        IR: kernels over the pool, argument slots set from values the kernels wrote, copies,
        column gathers), as one native call; its parallel kernels split like parallel_for's
        (`split` chunks per thread, default the pool's)."""
        nat = self._nat
        if nat.workers < self._want_workers:      # after fork(), in the child
            with nat.lock:
                nat.ensure_workers(self._want_workers)
        with nat.lock:
            nat.run_program(prog_addr, n, self.n_threads * (self.split if split is None else split))


class PoolShare:
    """One executor's use of the process's pool (`get_pool`): its own chunks per thread (`split`),
    passed with each job, so that one executor's choice (a mixed plan's, runtime/partitions.py)
    changes no other's; everything else is the pool's."""

    def __init__(self, pool: ThreadPool, split: int) -> None:
        self.pool, self.split = pool, split

    def __getattr__(self, name: str):
        return getattr(self.pool, name)

    def parallel_for(self, kernel_addr: int, args_addr: int, total: int, n_chunks: int | None = None,
                     *, min_chunk: int = 1) -> None:
        chunks = self.pool.n_threads * self.split if n_chunks is None else n_chunks
        self.pool.parallel_for(kernel_addr, args_addr, total, chunks, min_chunk=min_chunk)

    def run_program(self, prog_addr: int, n: int) -> None:
        self.pool.run_program(prog_addr, n, self.split)

    def run_async(self, prog_addr: int, n: int) -> Callable[[], None]:
        return self.pool.run_async(prog_addr, n, self.split)


_pool: ThreadPool | None = None
_pool_lock = threading.Lock()


def get_pool() -> ThreadPool:
    """The process-wide pool with ``default_threads()`` threads."""
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPool()
    return _pool
