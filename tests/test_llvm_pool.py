"""The native thread pool (backends/llvm_cpu/pool.py): results, chunking, stress, overhead, exit.

Test kernels are LLVM IR with the pool's kernel signature ``void k(void* args, i64 begin, i64 end)``,
compiled here with MCJIT. The stress and exit tests run in subprocesses with timeouts, so a deadlock
fails the test instead of hanging the run.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

llvm = pytest.importorskip("llvmlite.binding")

from strata_compiler.backends.llvm_cpu import pool as poolmod  # noqa: E402
from strata_compiler.backends.llvm_cpu.target import Target  # noqa: E402

_TESTS_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _TESTS_DIR.parent

KERNELS_IR = r"""
declare i64 @pthread_self()
declare void @llvm.x86.sse2.pause()

; y[i] = x[i] * 2 + i        args = { float* x, float* y }
define void @affine(ptr %args, i64 %b, i64 %e) {
entry:
  %x = load ptr, ptr %args
  %yp = getelementptr ptr, ptr %args, i64 1
  %y = load ptr, ptr %yp
  %c = icmp slt i64 %b, %e
  br i1 %c, label %loop, label %exit
loop:
  %i = phi i64 [ %b, %entry ], [ %i1, %loop ]
  %xa = getelementptr float, ptr %x, i64 %i
  %xv = load float, ptr %xa
  %fi = sitofp i64 %i to float
  %t = fmul float %xv, 2.0
  %r = fadd float %t, %fi
  %ya = getelementptr float, ptr %y, i64 %i
  store float %r, ptr %ya
  %i1 = add i64 %i, 1
  %more = icmp slt i64 %i1, %e
  br i1 %more, label %loop, label %exit
exit:
  ret void
}

; Records every call: slot = counter++; rec[slot] = {begin, end, pthread_self()}; then pauses `spin` times.
; args = { i64* counter, i64* rec, i64 spin }
define void @record(ptr %args, i64 %b, i64 %e) {
entry:
  %cnt = load ptr, ptr %args
  %rp = getelementptr ptr, ptr %args, i64 1
  %rec = load ptr, ptr %rp
  %sp = getelementptr ptr, ptr %args, i64 2
  %spin = load i64, ptr %sp
  %slot = atomicrmw add ptr %cnt, i64 1 seq_cst
  %base = mul i64 %slot, 3
  %a0 = getelementptr i64, ptr %rec, i64 %base
  store i64 %b, ptr %a0
  %a1 = getelementptr i64, ptr %a0, i64 1
  store i64 %e, ptr %a1
  %a2 = getelementptr i64, ptr %a0, i64 2
  %self = call i64 @pthread_self()
  store i64 %self, ptr %a2
  %z = icmp sgt i64 %spin, 0
  br i1 %z, label %sl, label %exit
sl:
  %j = phi i64 [ 0, %entry ], [ %j1, %sl ]
  call void @llvm.x86.sse2.pause()
  %j1 = add i64 %j, 1
  %m = icmp slt i64 %j1, %spin
  br i1 %m, label %sl, label %exit
exit:
  ret void
}

; args = { i64* sum, i64* calls }: sum += end - begin; calls += 1
define void @count(ptr %args, i64 %b, i64 %e) {
  %s = load ptr, ptr %args
  %cp = getelementptr ptr, ptr %args, i64 1
  %c = load ptr, ptr %cp
  %len = sub i64 %e, %b
  %o1 = atomicrmw add ptr %s, i64 %len seq_cst
  %o2 = atomicrmw add ptr %c, i64 1 seq_cst
  ret void
}

define void @empty(ptr %args, i64 %b, i64 %e) {
  ret void
}

; Compute-bound, memory-light: y[i] = f^k(x[i]) with f(v) = v * 0.999 + 0.5 (a dependent chain).
; args = { float* x, float* y, i64 k }
define void @compute(ptr %args, i64 %b, i64 %e) {
entry:
  %x = load ptr, ptr %args
  %yp = getelementptr ptr, ptr %args, i64 1
  %y = load ptr, ptr %yp
  %kp = getelementptr ptr, ptr %args, i64 2
  %k = load i64, ptr %kp
  %c = icmp slt i64 %b, %e
  br i1 %c, label %outer, label %exit
outer:
  %i = phi i64 [ %b, %entry ], [ %i1, %store ]
  %xa = getelementptr float, ptr %x, i64 %i
  %x0 = load float, ptr %xa
  br label %inner
inner:
  %j = phi i64 [ 0, %outer ], [ %j1, %inner ]
  %v = phi float [ %x0, %outer ], [ %v1, %inner ]
  %t = fmul float %v, 0x3FEFF7CEE0000000
  %v1 = fadd float %t, 0.5
  %j1 = add i64 %j, 1
  %mj = icmp slt i64 %j1, %k
  br i1 %mj, label %inner, label %store
store:
  %ya = getelementptr float, ptr %y, i64 %i
  store float %v1, ptr %ya
  %i1 = add i64 %i, 1
  %mi = icmp slt i64 %i1, %e
  br i1 %mi, label %outer, label %exit
exit:
  ret void
}

; Calls strata_parallel_for `iters` times from native code (its overhead without ctypes).
define void @bench(ptr %pf, ptr %fn, ptr %args, i64 %total, i64 %n, i64 %iters) {
entry:
  br label %loop
loop:
  %i = phi i64 [ 0, %entry ], [ %i1, %loop ]
  call void %pf(ptr %fn, ptr %args, i64 %total, i64 %n)
  %i1 = add i64 %i, 1
  %m = icmp slt i64 %i1, %iters
  br i1 %m, label %loop, label %exit
exit:
  ret void
}
"""

_ENGINES: list = []


def jit_kernels() -> dict[str, int]:
    """Compile KERNELS_IR; returns {name: address}. The engine is kept alive for the process."""
    tm = Target.host().machine()
    mod = llvm.parse_assembly(KERNELS_IR)
    mod.triple = tm.triple
    mod.data_layout = str(tm.target_data)
    mod.verify()
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(mod, pb)
    ee = llvm.create_mcjit_compiler(llvm.parse_assembly(""), tm)
    ee.add_object_file(llvm.ObjectFileRef.from_data(tm.emit_object(mod)))
    ee.finalize_object()
    _ENGINES.append((ee, tm, mod))
    return {n: ee.get_function_address(n) for n in ("affine", "record", "count", "empty", "compute", "bench")}


def expected_ranges(total: int, n: int) -> list[tuple[int, int]]:
    base, rem = divmod(total, n)
    out, b = [], 0
    for i in range(n):
        ln = base + (1 if i < rem else 0)
        if ln:
            out.append((b, b + ln))
        b += ln
    return out


def run_script(body: str, timeout: float) -> subprocess.CompletedProcess:
    script = "import sys\nsys.path[:0] = [%r, %r]\n" % (str(_REPO_ROOT), str(_TESTS_DIR)) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          cwd=str(_REPO_ROOT))


@pytest.fixture(scope="module")
def K() -> dict[str, int]:
    return jit_kernels()


@pytest.fixture(scope="module")
def pool2() -> poolmod.ThreadPool:
    return poolmod.ThreadPool(2)


def _affine_args(n: int):
    x = np.arange(n, dtype=np.float32) * 0.5 - 3.0
    y = np.full(n, np.nan, dtype=np.float32)
    args = (ctypes.c_void_p * 2)(x.ctypes.data, y.ctypes.data)
    return x, y, args


@pytest.mark.parametrize("total,n_chunks", [
    (0, None), (0, 4), (1, None), (1, 1), (1, 8), (2, 2), (3, 2), (5, 8), (7, 3), (10, 10),
    (100, None), (101, 4), (1000, 7), (1023, 16), (4096, 3), (100_003, 13), (50, 1000),
])
def test_affine_results(K, pool2, total, n_chunks):
    x, y, args = _affine_args(max(total, 1))
    pool2.parallel_for(K["affine"], ctypes.addressof(args), total, n_chunks)
    want = x[:total] * np.float32(2) + np.arange(total, dtype=np.float32)
    np.testing.assert_array_equal(y[:total], want)
    if total == 0:
        assert np.isnan(y).all()


def test_run_direct_and_single_thread_pool(K):
    x, y, args = _affine_args(100)
    p1 = poolmod.ThreadPool(1)
    p1.run(K["affine"], ctypes.addressof(args), 10, 20)
    assert np.isnan(y[:10]).all() and np.isnan(y[20:]).all()
    np.testing.assert_array_equal(y[10:20], x[10:20] * 2 + np.arange(10, 20, dtype=np.float32))
    p1.parallel_for(K["affine"], ctypes.addressof(args), 100)            # one chunk: direct call
    p1.parallel_for(K["affine"], ctypes.addressof(args), 100, 9)         # nine chunks, still correct
    np.testing.assert_array_equal(y, x * 2 + np.arange(100, dtype=np.float32))


def test_min_chunk_and_bad_arguments(K, pool2):
    rec_n = 64
    counter = ctypes.c_int64(0)
    rec = np.zeros((rec_n, 3), dtype=np.int64)
    args = (ctypes.c_int64 * 3)(ctypes.addressof(counter), rec.ctypes.data, 0)
    pool2.parallel_for(K["record"], ctypes.addressof(args), 100, 16, min_chunk=30)   # ceil(100/30) = 4 chunks
    got = sorted((int(b), int(e)) for b, e, _ in rec[:counter.value])
    assert got == expected_ranges(100, 4)
    with pytest.raises(ValueError):
        pool2.parallel_for(K["record"], ctypes.addressof(args), 10, 0)
    with pytest.raises(ValueError):
        poolmod.ThreadPool(0)


@pytest.mark.parametrize("total,n_chunks", [(1, 1), (2, 2), (17, 5), (64, 64), (1000, 2), (999, 31), (5, 40)])
def test_every_chunk_runs_exactly_once(K, pool2, total, n_chunks):
    cap = max(n_chunks, 1) + 4
    counter = ctypes.c_int64(0)
    rec = np.zeros((cap, 3), dtype=np.int64)
    args = (ctypes.c_int64 * 3)(ctypes.addressof(counter), rec.ctypes.data, 200)
    pool2.parallel_for(K["record"], ctypes.addressof(args), total, n_chunks)
    want = expected_ranges(total, min(n_chunks, total))
    assert counter.value == len(want)
    assert sorted((int(b), int(e)) for b, e, _ in rec[:counter.value]) == want


def test_split_default_chunks(K, monkeypatch):
    """STRATA_POOL_SPLIT=3 (the pool_split setting): a default parallel_for cuts 3 chunks per thread
    (min_chunk still caps it); a bad value is one clear error; unset, the caller's default."""
    monkeypatch.setenv("STRATA_POOL_SPLIT", "3")
    p = poolmod.ThreadPool(2)
    assert p.split == 3
    counter = ctypes.c_int64(0)
    rec = np.zeros((16, 3), dtype=np.int64)
    args = (ctypes.c_int64 * 3)(ctypes.addressof(counter), rec.ctypes.data, 0)
    p.parallel_for(K["record"], ctypes.addressof(args), 100)
    assert sorted((int(b), int(e)) for b, e, _ in rec[:counter.value]) == expected_ranges(100, 6)
    counter.value = 0
    p.parallel_for(K["record"], ctypes.addressof(args), 100, min_chunk=40)
    assert counter.value == 3
    monkeypatch.setenv("STRATA_POOL_SPLIT", "0")
    from strata_compiler.errors import UsageError
    with pytest.raises(UsageError, match="STRATA_POOL_SPLIT"):
        poolmod.pool_split()
    monkeypatch.delenv("STRATA_POOL_SPLIT")
    assert poolmod.pool_split() == 1 and poolmod.pool_split(4) == 4


def test_workers_take_chunks(K, pool2):
    """With two threads, chunks run on the caller and on the worker (pthread_self per chunk)."""
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_uint64
    me = libc.pthread_self()
    threads: set[int] = set()
    for _ in range(2000):
        counter = ctypes.c_int64(0)
        rec = np.zeros((16, 3), dtype=np.int64)
        args = (ctypes.c_int64 * 3)(ctypes.addressof(counter), rec.ctypes.data, 2000)   # ~ tens of us each
        pool2.parallel_for(K["record"], ctypes.addressof(args), 16, 16)
        assert sorted(map(tuple, rec[:, :2].tolist())) == expected_ranges(16, 16)
        threads |= {int(t) & (2**64 - 1) for t in rec[:, 2]}
        if len(threads) >= 2:
            break
    assert me in threads or len(threads) >= 2
    assert len(threads) >= 2, "no worker ever ran a chunk"


_SLEEP = """
import ctypes, time
import numpy as np
from test_llvm_pool import jit_kernels, _affine_args
from strata_compiler.backends.llvm_cpu import pool as poolmod
K = jit_kernels()
p = poolmod.ThreadPool(2)
p.parallel_for(K["empty"], 0, 2, 2)
deadline = time.monotonic() + 20.0    # generous: on a loaded 2-core CI box a worker may wait for a core
while p.workers_sleeping < p._nat.workers and time.monotonic() < deadline:
    time.sleep(0.01)
assert p.workers_sleeping == p._nat.workers >= 1, (p.workers_sleeping, p._nat.workers)
x, y, args = _affine_args(1000)            # and a sleeping pool still works
p.parallel_for(K["affine"], ctypes.addressof(args), 1000, 4)
np.testing.assert_array_equal(y, x * 2 + np.arange(1000, dtype=np.float32))
deadline = time.monotonic() + 20.0
while p.workers_sleeping < p._nat.workers and time.monotonic() < deadline:
    time.sleep(0.01)
poolmod.set_spin(spin_us=5e6)              # woken workers now spin for seconds: the count stays at 0
p.wake()                                   # no job: the sleepers wake (a host call's handler does this)
deadline = time.monotonic() + 20.0
while p.workers_sleeping and time.monotonic() < deadline:
    time.sleep(0.001)
assert p.workers_sleeping == 0, p.workers_sleeping
poolmod.set_spin()
p.parallel_for(K["affine"], ctypes.addressof(args), 1000, 4)     # and the pool's state is intact
np.testing.assert_array_equal(y, x * 2 + np.arange(1000, dtype=np.float32))
print("SLEEP_OK")
"""


def test_idle_workers_go_to_sleep():
    """Idle workers sleep on the futex, a sleeping pool still works, and wake() (no job) gets them up.
    In a process of its own: the workers are process-wide, so pool work on a thread that an
    earlier test left in the pytest process could keep them awake (in-process, this test failed
    once in a full run and never alone; that is the suspected cause, not a proven one)."""
    r = run_script(_SLEEP, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SLEEP_OK" in r.stdout


_STRESS = """
import ctypes, random, time
from test_llvm_pool import jit_kernels
from strata_compiler.backends.llvm_cpu import pool as poolmod
K = jit_kernels()
p = poolmod.ThreadPool(2)
s, c = ctypes.c_int64(0), ctypes.c_int64(0)
args = (ctypes.c_int64 * 2)(ctypes.addressof(s), ctypes.addressof(c))
rng = random.Random(7)

def phase(n_calls):
    for i in range(n_calls):
        total = rng.choice([1, 2, 3, 7, 64, 1000, rng.randrange(1, 5000)])
        n = rng.choice([2, 3, 4, 8, 16, 100])
        s.value = c.value = 0
        p.parallel_for(K["count"], ctypes.addressof(args), total, n)
        assert s.value == total and c.value == min(n, total), (i, total, n, s.value, c.value)

t = time.perf_counter()
phase(10_000)                                   # workers spinning between calls
t1 = time.perf_counter()
poolmod.set_spin(0, 0, 0)                       # every wait goes to the futex: exercises wake-ups
phase(3_000)
poolmod.set_spin()
t2 = time.perf_counter()
for i in range(200):                            # gaps long enough for the workers to fall asleep
    s.value = c.value = 0
    p.parallel_for(K["count"], ctypes.addressof(args), 1000, 2)
    assert s.value == 1000 and c.value == 2
    if i % 20 == 0:
        time.sleep(0.003)
print(f"STRESS_OK spin={t1 - t:.3f}s futex={t2 - t1:.3f}s")
"""


def test_stress_back_to_back_no_deadlock():
    r = run_script(_STRESS, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STRESS_OK" in r.stdout
    print(r.stdout.strip())


def _best_per_call(fn, calls: int, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def test_overhead_empty_kernel(K, pool2):
    empty = K["empty"]
    pf = pool2.parallel_for
    pf(empty, 0, 2, 2)
    py_pf = _best_per_call(lambda: pf(empty, 0, 2, 2), 2000)
    py_run = _best_per_call(lambda: pool2.run(empty, 0, 0, 1), 2000)
    bench = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                             ctypes.c_int64, ctypes.c_int64)(K["bench"])
    pf_addr = ctypes.cast(pool2._nat.parallel_for, ctypes.c_void_p).value
    native = _best_per_call(lambda: bench(pf_addr, empty, 0, 2, 2, 20000), 1, rounds=5) / 20000
    print(f"\npool overhead per parallel_for (empty kernel, 2 threads, 2 chunks): "
          f"python {py_pf * 1e6:.2f} us, native {native * 1e6:.3f} us; direct run() {py_run * 1e6:.2f} us")
    assert py_pf < 100e-6            # target < 10 us; loose bound for loaded CI machines


def test_speedup_compute_kernel(K):
    p = poolmod.ThreadPool(2)
    n, k = 4096, 1000
    x = np.linspace(0, 1, n, dtype=np.float32)
    y1 = np.zeros(n, dtype=np.float32)
    y2 = np.zeros(n, dtype=np.float32)
    a1 = (ctypes.c_int64 * 3)(x.ctypes.data, y1.ctypes.data, k)
    a2 = (ctypes.c_int64 * 3)(x.ctypes.data, y2.ctypes.data, k)
    t1 = _best_per_call(lambda: p.run(K["compute"], ctypes.addressof(a1), 0, n), 1, rounds=5)
    t2 = _best_per_call(lambda: p.parallel_for(K["compute"], ctypes.addressof(a2), n, 2), 1, rounds=5)
    np.testing.assert_array_equal(y1, y2)
    print(f"\ncompute kernel ({n} x {k} dependent fmul+fadd): 1 thread {t1 * 1e3:.2f} ms, "
          f"2 threads {t2 * 1e3:.2f} ms, speedup {t1 / t2:.2f}x")   # reported, not asserted: shared CI boxes


_EXIT = """
import ctypes, time, threading
from test_llvm_pool import jit_kernels
from strata_compiler.backends.llvm_cpu import pool as poolmod
K = jit_kernels()
p = poolmod.get_pool() if {use_default} else poolmod.ThreadPool(3)
s, c = ctypes.c_int64(0), ctypes.c_int64(0)
args = (ctypes.c_int64 * 2)(ctypes.addressof(s), ctypes.addressof(c))
for _ in range(100):
    p.parallel_for(K["count"], ctypes.addressof(args), 100, 4)
assert s.value == 100 * 100
time.sleep({sleep})
print("EXITING", flush=True)
"""


@pytest.mark.parametrize("use_default,sleep", [(True, 0.0), (False, 0.0), (True, 0.0005), (True, 0.1)])
def test_interpreter_exit_is_prompt(use_default, sleep):
    """Exit while workers spin, yield or sleep on the futex: no hang, no crash."""
    t = time.perf_counter()
    r = run_script(_EXIT.format(use_default=use_default, sleep=sleep), timeout=30)
    dt = time.perf_counter() - t
    assert r.returncode == 0, r.stdout + r.stderr
    assert "EXITING" in r.stdout
    assert dt < 15


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_pool_works_in_forked_child(K, pool2):
    x, y, args = _affine_args(1000)
    pool2.parallel_for(K["empty"], 0, 2, 2)
    pid = os.fork()
    if pid == 0:                                # child: no workers until the pool restarts them
        code = 1
        try:
            pool2.parallel_for(K["affine"], ctypes.addressof(args), 1000, 4)
            ok = bool((y == x * 2 + np.arange(1000, dtype=np.float32)).all())
            code = 0 if ok and pool2._nat.workers == 1 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while True:
        wpid, status = os.waitpid(pid, os.WNOHANG)
        if wpid:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("forked child hung")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0


def test_default_threads_and_singleton(monkeypatch):
    monkeypatch.setenv("STRATA_NUM_THREADS", "3")
    assert poolmod.default_threads() == 3
    from strata_compiler.errors import UsageError

    for bad in ("zero", "0"):
        monkeypatch.setenv("STRATA_NUM_THREADS", bad)
        with pytest.raises(UsageError, match="STRATA_NUM_THREADS"):
            poolmod.default_threads()
    monkeypatch.delenv("STRATA_NUM_THREADS")
    assert poolmod.default_threads() == len(os.sched_getaffinity(0))
    assert poolmod.get_pool() is poolmod.get_pool()


def test_segment_program_instructions(K, pool2):
    """strata_run_program: PAR with a fixed and a count-sized total (chunked like parallel_for, min_chunk
    honoured), ONE, SET from a count, COPY, GATHER of 32-bit columns; in order, as one native call."""
    P = 10
    prog = np.zeros((8, 10), np.int64)
    x, y, args = _affine_args(64)
    counter = ctypes.c_int64(0)
    rec = np.zeros((64, 3), dtype=np.int64)
    rargs = (ctypes.c_int64 * 3)(ctypes.addressof(counter), rec.ctypes.data, 0)
    count = np.array([5, 3], np.int64)              # as a pairs kernel leaves it: [P, nA]
    slot = np.zeros(2, np.int64)
    src = np.arange(24, dtype=np.float32).reshape(3, 8)
    dst = np.full((3, 4), -1, np.float32)
    idx = np.array([7, 0, 3, 3], np.int64)
    cp_src = np.arange(16, dtype=np.int32)
    cp_dst = np.zeros(16, np.int32)
    prog[0] = (0, K["affine"], ctypes.addressof(args), 4, count.ctypes.data + 8, 20, 1, 0, 0, 0)   # 4 + 3 * 20 = 64
    prog[1] = (0, K["record"], ctypes.addressof(rargs), 0, count.ctypes.data, 7, 12, 0, 0, 0)      # 35 items, >= 12 each
    prog[2] = (1, K["record"], ctypes.addressof(rargs), 100, 0, 0, 0, 0, 103, 0)                   # one call [100, 103)
    prog[3] = (2, 0, 0, 1, count.ctypes.data, P, 0, slot.ctypes.data + 8, 0, 0)                     # slot[1] = 5 * 10 + 1
    prog[4] = (3, 0, 0, cp_src.nbytes, cp_src.ctypes.data, 0, 0, cp_dst.ctypes.data, 0, 0)
    prog[5] = (4, 0, 0, 3, src.ctypes.data, 8, 4, dst.ctypes.data, idx.ctypes.data, 4)
    prog[6] = (0, K["affine"], ctypes.addressof(args), 0, 0, 0, 1, 0, 0, 0)                        # empty: skipped
    prog[7] = (9, 0, 0, 0, 0, 0, 0, 0, 0, 0)                                                        # unknown kind: no-op
    pool2.run_program(prog.ctypes.data, len(prog))
    np.testing.assert_array_equal(y, x * 2 + np.arange(64, dtype=np.float32))
    calls = sorted((int(b), int(e)) for b, e, _ in rec[:counter.value])
    assert calls == sorted(expected_ranges(35, 2) + [(100, 103)])      # 2 threads, ceil(35 / 12) = 3 > 2
    assert slot[1] == 51 and slot[0] == 0
    np.testing.assert_array_equal(cp_dst, cp_src)
    np.testing.assert_array_equal(dst, src[:, idx])


def test_segment_program_mask_multiplies_and_counts(pool2):
    """MASK: an expert cache's host side, routing weights times the nonresident mask (a strided
    source), and the count of nonzero weights per expert added to the counts."""
    comb = np.zeros((3, 8), np.float32)
    comb[:, :5] = [[0.5, 0, 0.25, 0, 0.25], [0, 1.0, 0, 0, 0], [0.2, 0, 0, 0.8, 0]]
    mask = np.array([1, 0, 1, 0, 1], np.float32)
    out = np.full((3, 5), np.nan, np.float32)
    counts = np.array([1, 0, 0, 0, 0], np.int64)
    prog = np.array([(6, counts.ctypes.data, 0, 3, comb.ctypes.data, 8, 5, out.ctypes.data, mask.ctypes.data, 5)],
                    np.int64)
    pool2.run_program(prog.ctypes.data, 1)
    np.testing.assert_array_equal(out, comb[:, :5] * mask)
    np.testing.assert_array_equal(counts, [1 + 2, 1, 1, 1, 1])


def test_segment_program_on_the_runner_thread(K, pool2):
    """strata_async_start / strata_async_wait: the runner thread runs a program (its kernels over the
    workers) while the poster goes on; the wait returns once it is done; many in a row."""
    x, y, args = _affine_args(1000)
    counter = ctypes.c_int64(0)
    rec = np.zeros((64, 3), dtype=np.int64)
    rargs = (ctypes.c_int64 * 3)(ctypes.addressof(counter), rec.ctypes.data, 20000)
    prog = np.zeros((2, 10), np.int64)
    prog[0] = (1, K["record"], ctypes.addressof(rargs), 0, 0, 0, 0, 0, 1, 0)     # one slow call first
    prog[1] = (0, K["affine"], ctypes.addressof(args), 1000, 0, 0, 1, 0, 0, 0)
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong
    for _ in range(50):
        y[:] = np.nan
        counter.value = 0
        wait = pool2.run_async(prog.ctypes.data, 2)
        wait()
        np.testing.assert_array_equal(y, x * 2 + np.arange(1000, dtype=np.float32))
        assert counter.value == 1
        assert int(np.uint64(rec[0, 2])) != libc.pthread_self()     # the runner ran it, not this thread
