"""The hardware probes behind `stratac probe-hw` and `stratac compile --target auto`: measuring
this machine into a HardwareProfile (strata_compiler/hwprofile.py, the data model).

Every rate is the median of a few repetitions, in bytes or flop per second:
  host  CPU model, physical cores, ISA flags (LLVM's view of the host, as the llvm backend
        compiles for it); RAM total / available (/proc/meminfo, capped by a cgroup limit);
        read bandwidth: a JIT-compiled parallel f32 sum over a large array (STREAM "sum");
        GEMV per weight format: the llvm backend's own `linear` kernel at batch 1 over a weight
        larger than the last-level cache, with the runtime's activations (q8 blocks for
        int8/int4); matmul flop/s per format: the same kernel with several tokens (prefill).
  gpu   None when JAX sees no GPU. Else the device's memory limit; copy bandwidth (a jitted
        y = x * a, bytes read + written); GEMV per format through the xla backend's decode
        `matvec`; a bf16 matmul rate; host -> device from pageable NumPy memory and from pinned
        host memory (a `pinned_host` JAX array; null with a note where unsupported); device -> host.
  disk  read bandwidth of the filesystem holding a directory: a fresh test file, fsync'd and
        dropped from the page cache (posix_fadvise DONTNEED), read back in large blocks.

It measures with both backends' kernels, so it sits beside them, at the backends package level.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

from strata_compiler.errors import BackendError, UsageError
from strata_compiler.formats import FORMATS, get_format
from strata_compiler.hwprofile import (PROFILE_VERSION, host_memory, CpuIsa, DiskProfile, GpuProfile, HardwareProfile,
                                       HostProfile)

@dataclass(frozen=True)
class ProbeSizes:
    reps: int
    read_bytes: int            # host read-bandwidth array
    gemv_bytes: int            # weight bytes one GEMV streams (host and GPU): beyond the caches
    gemv_k: int                # its columns
    matmul: tuple[int, int, int]   # CPU matmul tokens M, rows N, columns K
    gpu_bytes: int             # GPU copy and transfer arrays
    gpu_matmul: int            # square bf16 matmul size
    disk_bytes: int


FULL = ProbeSizes(reps=10, read_bytes=1 << 30, gemv_bytes=256 << 20, gemv_k=4096, matmul=(64, 4096, 4096),
                  gpu_bytes=1 << 30, gpu_matmul=8192, disk_bytes=256 << 20)
QUICK = ProbeSizes(reps=3, read_bytes=128 << 20, gemv_bytes=64 << 20, gemv_k=4096, matmul=(16, 2048, 2048),
                   gpu_bytes=256 << 20, gpu_matmul=4096, disk_bytes=16 << 20)


def probe(quick: bool = False, disk_dir: Path | str = ".", progress: Callable[[str], None] | None = None,
          disk_bytes: int | None = None, threads: int | None = None) -> HardwareProfile:
    """Measure this machine. `quick`: small sizes and few repetitions (seconds, rough figures)."""
    sizes = QUICK if quick else FULL
    if disk_bytes is not None:
        sizes = dataclasses.replace(sizes, disk_bytes=disk_bytes)
    say = progress or (lambda msg: None)
    notes: list[str] = []
    host = measure_host(sizes, say, notes, threads)
    from .xla.device import gpus

    devs = gpus()
    gpu = None
    if devs:
        gpu = measure_gpu(devs[0], sizes, say, notes)
    else:
        say("gpu: none visible to JAX")
    say(f"disk: reading {sizes.disk_bytes / 2**20:.0f} MiB in {disk_dir}")
    disk = measure_disk(Path(disk_dir), sizes.disk_bytes, notes, reps=1 if quick else 3)
    return HardwareProfile(PROFILE_VERSION, datetime.now(timezone.utc).isoformat(timespec="seconds"), quick,
                           _software(), host, gpu, disk, tuple(notes))


def _median_seconds(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _device_seconds(fn: Callable[[], object], reps: int, inner: int = 8) -> float:
    """Median seconds per call of a jitted JAX function, from batches of `inner` calls queued
    back to back and waited for once: the device's time, not the host's round trip per call."""
    import jax

    jax.block_until_ready(fn())         # compiles
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn()                  # the previous output is freed once its kernel is done
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _weight_block(fmt: str, K: int) -> tuple[dict[str, np.ndarray], int]:
    """Stored arrays of 64 rows of a K-column weight in `fmt` (group 32) and the group size the
    kernels take. Measurements repeat the block to the rows they need: kernel speed does not
    depend on the values, and quantizing a big matrix would take longer than measuring it."""
    F = get_format(fmt)
    G = 32 if F.grouped else 0
    return F.quantize(np.random.default_rng(0).standard_normal((64, K), dtype=np.float32), G or 32), G


def _gemv_rows(fmt: str, K: int, nbytes: int) -> int:
    """Rows of a K-column `fmt` weight holding about `nbytes` (a multiple of 64)."""
    data, scales = get_format(fmt).row_bytes(K, 32)
    return max(64, nbytes // (data + scales) // 64 * 64)


# -- host ----------------------------------------------------------------------------------------


def measure_host(sizes: ProbeSizes, say: Callable[[str], None], notes: list[str],
                 threads: int | None = None) -> HostProfile:
    import llvmlite.binding as llvm

    from .llvm_cpu.pool import ThreadPool, default_threads
    from .llvm_cpu.target import Target

    threads = threads or default_threads()
    try:
        target = Target.host(force="native")    # the real hardware, whatever STRATA_CPU_FEATURES says
    except BackendError as e:
        target = None
        notes.append(f"host: no llvm kernel figures ({e})")
    feats = set(llvm.get_host_cpu_features().flatten().split(","))   # LLVM is initialised by Target.host
    isa = CpuIsa(avx2="+avx2" in feats, fma="+fma" in feats, avx512f="+avx512f" in feats,
                 avx512bw="+avx512bw" in feats, avx512_vnni="+avx512vnni" in feats,
                 avx512_bf16="+avx512bf16" in feats,
                 amx="+amx-tile" in feats and ("+amx-int8" in feats or "+amx-bf16" in feats))
    total, available = host_memory()
    op_s = None
    gemv: dict[str, float] = {}
    flops: dict[str, float] = {}
    M, N, K = sizes.matmul
    say(f"host: memory read bandwidth ({sizes.read_bytes / 2**20:.0f} MiB, {threads} threads)")
    if target is None:
        read_bw = _numpy_read_bandwidth(sizes.read_bytes, sizes.reps)
    else:
        from .llvm_cpu.jit import library

        pool, lib = ThreadPool(threads), library(target)
        read_bw = read_bandwidth(pool, lib, target, sizes.read_bytes, sizes.reps)
        for fmt in FORMATS:
            say(f"host: {fmt} GEMV ({sizes.gemv_bytes / 2**20:.0f} MiB of weights) and matmul ({M} tokens)")
            rows = _gemv_rows(fmt, sizes.gemv_k, sizes.gemv_bytes)
            t, nbytes = time_linear(pool, lib, target, fmt, rows, sizes.gemv_k, sizes.reps)
            gemv[fmt] = nbytes / t
            t, _ = time_linear(pool, lib, target, fmt, N, K, max(2, sizes.reps // 2), M=M)
            flops[fmt] = 2.0 * M * N * K / t
        say("host: kernel dispatch (a 16 x 64 f32 GEMV)")
        op_s, _ = time_linear(pool, lib, target, "f32", 16, 64, max(20, sizes.reps))
    return HostProfile(cpu=_cpu_model() or (target.cpu if target else platform.machine()),
                       llvm_cpu=llvm.get_host_cpu_name(), cores=_physical_cores(), threads=threads, isa=isa,
                       ram_bytes=total, ram_available_bytes=min(available, total), read_bandwidth=read_bw,
                       gemv=gemv, matmul_flops=flops, matmul_tokens=M,
                       op_seconds=op_s)


def read_bandwidth(pool, lib, target, nbytes: int, reps: int) -> float:
    """B/s of a parallel f32 sum over `nbytes` (STREAM-style 'sum': reads only), on the pool's threads."""
    from .llvm_cpu.codegen.common import KernelSource, fn_attrs, load_args

    params = ("x", "out", "chunk")
    ir = f"""
define void @stream_sum(ptr noalias %args, i64 %begin, i64 %end) #0 {{
entry:
{load_args(params, {"x", "out"})}
  %lo = mul i64 %begin, %chunk
  %hi = mul i64 %end, %chunk
  br label %loop
loop:
  %i = phi i64 [%lo, %entry], [%i1, %loop]
  %acc = phi float [0.0, %entry], [%acc1, %loop]
  %p = getelementptr inbounds float, ptr %x, i64 %i
  %v = load float, ptr %p, align 4
  %acc1 = fadd reassoc contract float %acc, %v
  %i1 = add nuw nsw i64 %i, 1
  %d = icmp eq i64 %i1, %hi
  br i1 %d, label %exit, label %loop
exit:
  %op = getelementptr inbounds float, ptr %out, i64 %begin
  store float %acc1, ptr %op, align 4
  ret void
}}
attributes #0 = {{ {fn_attrs(target)} }}
"""
    src = KernelSource("stream_sum", ir, params, "chunks")
    addr = lib.address(src.ir, src.name)
    n = nbytes // 4
    chunks = 256
    n -= n % chunks
    x = np.ones(n, np.float32)
    out = np.zeros(chunks, np.float32)
    args = (ctypes.c_int64 * 3)(x.ctypes.data, out.ctypes.data, n // chunks)
    t = _median_seconds(lambda: pool.parallel_for(addr, ctypes.addressof(args), chunks, n_chunks=pool.n_threads),
                        reps, warmup=0)
    assert abs(out.sum() - n) < n * 1e-3
    return x.nbytes / t


def _numpy_read_bandwidth(nbytes: int, reps: int) -> float:
    """B/s of NumPy's sum over `nbytes` (one thread): where the llvm backend cannot run."""
    x = np.ones(nbytes // 4, np.float32)
    return x.nbytes / _median_seconds(x.sum, reps)


def time_linear(pool, lib, target, fmt: str, N: int, K: int, reps: int, *, M: int = 1,
                q8: bool | None = None) -> tuple[float, int]:
    """Median seconds of one call of the llvm backend's `linear` kernel, y[M, N] = x[M, K] @ W[N, K]^T
    with W in `fmt` (group 32), after two warm-up calls, and W's bytes. `q8`: activations as q8
    blocks (default: as the runtime has them, for int8/int4); their quantization is not timed."""
    from .llvm_cpu.codegen.dot import needs_q8
    from .llvm_cpu.codegen.elementwise import quantize_q8
    from .llvm_cpu.codegen.linear import PARAMS, LinearSpec, generate

    block, G = _weight_block(fmt, K)
    arrays = {k: np.resize(a, (N,) + a.shape[1:]) for k, a in block.items()}
    q8 = needs_q8(fmt, G) if q8 is None else q8
    w, s = arrays.get("qs", arrays.get("w")), arrays.get("scales")
    x = np.random.default_rng(1).standard_normal((M, K), dtype=np.float32)
    ng = -(-K // 32)
    xq, xd, xs = np.zeros((M, ng * 32), np.int8), np.zeros((M, ng), np.float32), np.zeros((M, ng), np.int32)
    if q8:
        from .llvm_cpu.codegen.dot import pair_layout

        qsrc = quantize_q8(K, target, pair_layout(target, fmt, G))
        qa = (ctypes.c_int64 * len(qsrc.params))(*[{"x": x.ctypes.data, "xq": xq.ctypes.data, "xd": xd.ctypes.data,
                                                    "xs": xs.ctypes.data, "ldx": K}[p] for p in qsrc.params])
        pool.run(lib.address(qsrc.ir, qsrc.name), ctypes.addressof(qa), 0, M)
    elif G and K % G:
        xp = np.zeros((M, ng * 32), np.float32)
        xp[:, :K] = x
        x = xp
    src = generate(LinearSpec(fmt, N, K, G, q8), target)
    addr = lib.address(src.ir, src.name)
    y = np.zeros((M, N), np.float32)
    vals = dict(y=y.ctypes.data, x=(xq if q8 else x).ctypes.data, xd=xd.ctypes.data, xs=xs.ctypes.data,
                w=w.ctypes.data, s=0 if s is None else s.ctypes.data, b=0, r=0, xidx=0, M=M, ldx=x.shape[1],
                ldy=N, ldr=N)
    args = (ctypes.c_int64 * len(PARAMS))(*[vals[p] for p in PARAMS])
    t = _median_seconds(lambda: pool.parallel_for(addr, ctypes.addressof(args), N, min_chunk=16), reps, warmup=2)
    return t, w.nbytes + (0 if s is None else s.nbytes)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def _physical_cores() -> int:
    """Distinct (package, core) pairs in /proc/cpuinfo; the logical CPU count where it has none."""
    cores, phys = set(), "0"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key == "physical id":
                phys = val.strip()
            elif key == "core id":
                cores.add((phys, val.strip()))
    except OSError:
        pass
    return len(cores) or os.cpu_count() or 1


# -- gpu -----------------------------------------------------------------------------------------


def measure_gpu(dev, sizes: ProbeSizes, say: Callable[[str], None], notes: list[str]) -> GpuProfile:
    """Figures of one JAX device (a GPU in `probe`; any device works, which is how tests run it)."""
    import jax
    import jax.numpy as jnp

    from .xla.dequant import matvec
    from strata_compiler.ir import WeightSpec

    name = getattr(dev, "device_kind", "") or str(dev)
    stats = dev.memory_stats() or {}
    memory = int(stats.get("bytes_limit") or 0)
    if not memory:
        notes.append(f"gpu: {name}: JAX reports no memory limit; give the size with --gpu-mem")
    reps = sizes.reps
    sync = jax.block_until_ready

    say(f"gpu: {name}: copy bandwidth ({sizes.gpu_bytes / 2**20:.0f} MiB)")
    host = np.ones(sizes.gpu_bytes // 4, np.float32)
    x = jax.device_put(host, dev)
    scale = jax.jit(lambda a: a * np.float32(1.0001))
    copy_bw = 2 * x.nbytes / _device_seconds(lambda: scale(x), reps)

    gemv: dict[str, float] = {}
    K = sizes.gemv_k
    for fmt in FORMATS:
        say(f"gpu: {fmt} GEMV ({sizes.gemv_bytes / 2**20:.0f} MiB of weights)")
        rows = _gemv_rows(fmt, K, sizes.gemv_bytes)
        block, G = _weight_block(fmt, K)
        w = {k: jnp.tile(jax.device_put(a, dev), (rows // 64, 1)) for k, a in block.items()}
        spec = WeightSpec("probe", (rows, K), (), fmt=fmt, group_size=G)
        v = jax.device_put(np.ones((1, K), np.float32), dev)
        f = jax.jit(lambda w, v, spec=spec: matvec(jnp, spec, w, v))
        gemv[fmt] = sum(a.nbytes for a in w.values()) / _device_seconds(lambda: f(w, v), reps)
        del w

    n = sizes.gpu_matmul
    say(f"gpu: bf16 matmul {n} x {n} x {n}")
    a = jax.device_put(np.ones((n, n), np.float32), dev).astype(jnp.bfloat16)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    mm_flops = 2.0 * n ** 3 / _device_seconds(lambda: mm(a, a), reps)
    del a

    say(f"gpu: host <-> device copies ({host.nbytes / 2**20:.0f} MiB)")
    h2d = host.nbytes / _median_seconds(lambda: sync(jax.device_put(host, dev)), reps)
    h2d_pinned = _pinned_h2d(dev, host, reps, notes)
    times = []
    for i in range(reps + 1):
        y = sync(scale(x))          # a fresh array each time: device_get caches the host copy on it
        t0 = time.perf_counter()
        jax.device_get(y)
        times.append(time.perf_counter() - t0)
        del y
    d2h = host.nbytes / statistics.median(times[1:])
    part_s = _partition_seconds(dev, reps, say)
    return GpuProfile(name=name, memory_bytes=memory, copy_bandwidth=copy_bw, gemv=gemv, matmul_flops=mm_flops,
                      h2d_pageable=h2d, h2d_pinned=h2d_pinned, d2h=d2h, partition_seconds=part_s)


def _pinned_h2d(dev, host: np.ndarray, reps: int, notes: list[str]) -> float | None:
    """Host -> device bytes/s from pinned host memory; None with a note where JAX lacks `pinned_host`."""
    import jax

    sync = jax.block_until_ready
    try:
        from jax.sharding import SingleDeviceSharding

        pinned = sync(jax.device_put(host, SingleDeviceSharding(dev, memory_kind="pinned_host")))
        on_dev = SingleDeviceSharding(dev, memory_kind="device")
        return host.nbytes / _median_seconds(lambda: sync(jax.device_put(pinned, on_dev)), reps)
    except Exception as e:      # noqa: BLE001 - any failure of this optional API only loses the figure
        msg = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        notes.append(f"gpu: no pinned host->device figure (JAX: {type(e).__name__}{': ' + msg if msg else ''})")
        return None


def _partition_seconds(dev, reps: int, say: Callable[[str], None]) -> float:
    """Seconds of a tiny jitted call with its copies in and out: the fixed cost of each partition switch."""
    import jax

    tiny = jax.jit(lambda x, pos: (x * 2.0 + 1.0, pos + 1))
    xin = np.ones((1, 2048), np.float32)
    from .xla import cuda_rt

    if cuda_rt.raw_mode(dev.platform):   # the runtime's own hand-off: raw copies through staging arrays
        say("gpu: partition round trip (a tiny jitted call, raw copies in and out)")
        st, xout = cuda_rt.Staging(dev), np.empty((1, 2048), np.float32)

        def trip():
            y = tiny(st.stage(0, xin), st.stage(1, np.asarray(3, np.int32)))[0]
            st.guard = y
            cuda_rt.fetch_into(y, xout)
        return _median_seconds(trip, max(20, reps), warmup=3)
    say("gpu: partition round trip (a tiny jitted call, NumPy in and out)")
    return _median_seconds(lambda: np.asarray(tiny(xin, np.int32(3))[0]), max(20, reps), warmup=3)


# -- disk ----------------------------------------------------------------------------------------


def measure_disk(directory: Path, nbytes: int, notes: list[str], reps: int = 1) -> DiskProfile:
    """Cold read bandwidth of the filesystem holding `directory`, from a temp file written there."""
    directory = Path(directory)
    block = np.random.default_rng(2).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()   # incompressible
    try:
        fd, tmp = tempfile.mkstemp(prefix=".strata-probe-", suffix=".tmp", dir=directory)
    except OSError as e:
        raise UsageError(f"--disk-dir {directory}: cannot create a test file there ({e.strerror})") from None
    dropped = hasattr(os, "posix_fadvise")
    try:
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                left = nbytes
                while left > 0:
                    left -= f.write(block[:left])
                os.fsync(f.fileno())
        except OSError as e:
            raise UsageError(f"--disk-dir {directory}: cannot write a {nbytes / 2**20:.0f} MiB test file "
                             f"({e.strerror})") from None
        buf = memoryview(bytearray(8 << 20))
        times = []
        for _ in range(reps):
            with open(tmp, "rb", buffering=0) as f:
                if dropped:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                while f.readinto(buf):
                    pass
                times.append(time.perf_counter() - t0)
    finally:
        Path(tmp).unlink(missing_ok=True)
    fs = _filesystem(directory)
    if not dropped:
        notes.append("disk: the page cache could not be dropped here: the read figure may be memory speed")
    if fs in ("tmpfs", "ramfs"):
        notes.append(f"disk: {directory} is on {fs}: the read figure is memory speed")
    return DiskProfile(path=str(directory.resolve()), filesystem=fs, read_bandwidth=nbytes / statistics.median(times),
                       test_bytes=nbytes, cache_dropped=dropped)


def _filesystem(directory: Path) -> str:
    """The type of the mount holding `directory` (longest matching mount point in /proc/mounts)."""
    path, best, fs = str(directory.resolve()), -1, ""
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            mnt = parts[1].replace("\\040", " ")
            inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) > best:
                best, fs = len(mnt), parts[2]
    except OSError:
        pass
    return fs


def _software() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import llvmlite.binding as llvm

    out = {"python": platform.python_version(), "os": platform.platform(),
           "llvm": ".".join(map(str, llvm.llvm_version_info))}
    for pkg in ("strata", "numpy", "llvmlite", "jax", "jaxlib"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out
