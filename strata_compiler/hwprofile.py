"""The hardware profile: how much this machine holds, and how fast it streams and multiplies weights.

`stratac probe-hw -o hw.json` measures it once (`probe`); the placement pass reads it back
(`HardwareProfile.from_json`) and asks it how long things take (`cpu_gemv_seconds`,
`gpu_gemv_seconds`, `h2d_seconds`, `disk_seconds`, ...). `override` swaps in the memory sizes
of another machine, to plan for it from a profile of this one.

What is measured, and how (every rate is the median of a few repetitions, in bytes or flop per
second):
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
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import platform
import statistics
import tempfile
import time
import types
import typing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import BackendError, UsageError
from .formats import FORMATS, get_format

PROFILE_VERSION = 1
GB = 1e9

# ------------------------------------------------------------------------------------------------
# the profile


def _unhashed():
    """A dict field left out of the hash, so that profiles stay hashable (they are frozen)."""
    return dataclasses.field(hash=False)


@dataclass(frozen=True)
class CpuIsa:
    """Vector/matrix extensions of the host CPU, as LLVM detects them."""

    avx2: bool
    fma: bool
    avx512f: bool
    avx512bw: bool
    avx512_vnni: bool
    avx512_bf16: bool
    amx: bool                  # AMX tiles with int8 or bf16 multiplies


@dataclass(frozen=True)
class HostProfile:
    cpu: str                   # model name (/proc/cpuinfo)
    llvm_cpu: str              # LLVM's name for it: what the kernels are compiled for
    cores: int                 # physical cores (logical CPUs where the topology is unknown)
    threads: int               # threads the measurements ran on (STRATA_NUM_THREADS, else the usable CPUs)
    isa: CpuIsa
    ram_bytes: int
    ram_available_bytes: int
    read_bandwidth: float      # B/s
    gemv: dict[str, float] = _unhashed()     # format -> weight B/s at batch 1 ({}: the llvm backend cannot run)
    matmul_flops: dict[str, float] = _unhashed()   # format -> flop/s with `matmul_tokens` tokens
    matmul_tokens: int
    op_seconds: float | None = None   # one tiny llvm kernel call from Python: the per-op dispatch cost


@dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_bytes: int          # what JAX may allocate (its default: 75% of the device); 0: unknown
    copy_bandwidth: float      # B/s, read + written
    gemv: dict[str, float] = _unhashed()     # format -> weight B/s at batch 1 (the xla backend's matvec)
    matmul_flops: float        # bf16 x bf16 -> f32, square
    h2d_pageable: float        # B/s from ordinary NumPy memory
    h2d_pinned: float | None   # B/s from pinned host memory; None: not measurable (see notes)
    d2h: float                 # B/s
    partition_seconds: float | None = None   # a tiny jitted call with its activation in and out (as the runtime hands off): one partition's overhead


@dataclass(frozen=True)
class DiskProfile:
    path: str                  # the directory measured
    filesystem: str            # its mount's type (/proc/mounts), "" if unknown
    read_bandwidth: float      # B/s, cold (page cache dropped when cache_dropped)
    test_bytes: int
    cache_dropped: bool


@dataclass(frozen=True)
class HardwareProfile:
    version: int
    measured_at: str           # ISO 8601, UTC
    quick: bool                # measured with `--quick` (small sizes, rough figures)
    software: dict[str, str] = _unhashed()   # versions of what measured it
    host: HostProfile
    gpu: GpuProfile | None
    disk: DiskProfile
    notes: tuple[str, ...]     # what could not be measured, and why

    # -- time estimates (seconds) for the placement pass ------------------------------------------

    def cpu_gemv_seconds(self, fmt: str, nbytes: int) -> float:
        """Streaming `nbytes` of `fmt` weights through a CPU matrix-vector product (decode).
        A format the profile lacks streams at the memory read bandwidth."""
        get_format(fmt)
        return nbytes / self.host.gemv.get(fmt, self.host.read_bandwidth)

    def cpu_matmul_seconds(self, fmt: str, flops: float) -> float:
        """`flops` of a CPU matrix product against `fmt` weights (prefill). A format the profile
        lacks runs at its slowest measured rate."""
        get_format(fmt)
        rates = self.host.matmul_flops
        if not rates:
            raise UsageError("the hardware profile has no CPU matmul rates (the llvm backend could not run "
                             "where it was measured)")
        return flops / rates.get(fmt, min(rates.values()))

    def gpu_gemv_seconds(self, fmt: str, nbytes: int) -> float:
        """Streaming `nbytes` of `fmt` weights through a GPU matrix-vector product (decode).
        A format the profile lacks streams at half the copy bandwidth (reads only)."""
        get_format(fmt)
        gpu = self._gpu()
        return nbytes / gpu.gemv.get(fmt, gpu.copy_bandwidth / 2)

    def gpu_matmul_seconds(self, flops: float) -> float:
        return flops / self._gpu().matmul_flops

    def h2d_seconds(self, nbytes: int, pinned: bool = True) -> float:
        """Host -> GPU copy; pinned where the profile has a pinned figure, else pageable."""
        gpu = self._gpu()
        rate = gpu.h2d_pinned if pinned and gpu.h2d_pinned is not None else gpu.h2d_pageable
        return nbytes / rate

    def d2h_seconds(self, nbytes: int) -> float:
        return nbytes / self._gpu().d2h

    def disk_seconds(self, nbytes: int) -> float:
        """Reading `nbytes` cold from the disk that was measured."""
        return nbytes / self.disk.read_bandwidth

    def _gpu(self) -> GpuProfile:
        if self.gpu is None:
            raise UsageError("the hardware profile has no GPU (JAX saw none where it was measured): "
                             "probe the machine that has it (stratac probe-hw)")
        return self.gpu

    # -- JSON ----------------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    def save(self, path: Path) -> None:
        """Write the JSON atomically: a temp file beside `path`, then a rename."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.to_json())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @staticmethod
    def from_json(path: Path | str) -> "HardwareProfile":
        """Read a profile written by `stratac probe-hw`; a missing file, bad JSON, an other version
        or a missing or ill-typed field is a UsageError naming the file and the field."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UsageError(f"{path}: no such hardware profile (write one: stratac probe-hw -o {path})") from None
        except IsADirectoryError:
            raise UsageError(f"{path}: is a directory, not a hardware profile (a JSON file)") from None
        except OSError as e:
            raise UsageError(f"{path}: cannot read the hardware profile ({e.strerror})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            where = f" at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
            raise UsageError(f"{path}: not a JSON hardware profile ({type(e).__name__}{where})") from None
        if not isinstance(data, dict):
            raise UsageError(f"{path}: not a hardware profile (expected a JSON object)")
        if data.get("version") != PROFILE_VERSION:
            found = f"is {json.dumps(data['version'])[:20]}" if "version" in data else "is missing"
            raise UsageError(f"{path}: field version {found}; this Strata reads hardware profiles of version "
                             f"{PROFILE_VERSION}: measure again with `stratac probe-hw -o {path}`")
        try:
            return _decode(HardwareProfile, data, "")
        except _FieldError as e:
            raise UsageError(f"{path}: {e}") from None


class _FieldError(Exception):
    pass


def _decode(tp, v, where: str):
    """JSON value -> `tp` (the dataclasses above and their field types), checking as it goes."""
    def bad(expected: str) -> _FieldError:
        return _FieldError(f"field {where}: expected {expected}, got {json.dumps(v)[:40]}")

    if typing.get_origin(tp) in (typing.Union, types.UnionType):          # X | None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if v is None else _decode(inner, v, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(v, dict):
            raise bad("an object")
        hints = typing.get_type_hints(tp)
        kw = {}
        for f in dataclasses.fields(tp):
            key = f"{where}.{f.name}" if where else f.name
            if f.name not in v:
                if f.default is None:      # an optional figure newer than the file: unknown
                    kw[f.name] = None
                    continue
                raise _FieldError(f"field {key} is missing")
            kw[f.name] = _decode(hints[f.name], v[f.name], key)
        return tp(**kw)
    if typing.get_origin(tp) is dict:
        if not isinstance(v, dict):
            raise bad("an object")
        return {k: _decode(typing.get_args(tp)[1], x, f"{where}.{k}") for k, x in v.items()}
    if typing.get_origin(tp) is tuple:
        if not isinstance(v, list):
            raise bad("a list")
        return tuple(_decode(typing.get_args(tp)[0], x, f"{where}[{i}]") for i, x in enumerate(v))
    if tp is bool:
        if not isinstance(v, bool):
            raise bad("true or false")
        return v
    if tp is str:
        if not isinstance(v, str):
            raise bad("a string")
        return v
    if tp is int:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise bad("a whole number >= 0")
        return v
    if tp is float:     # every float is a rate: positive and finite
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise bad("a positive number")
        return float(v)
    raise TypeError(f"hwprofile: no JSON decoding for {tp!r}")   # pragma: no cover - a Strata bug


def override(profile: HardwareProfile, gpu_mem: int | str | None = None,
             host_mem: int | str | None = None) -> HardwareProfile:
    """A copy with the memory sizes of another machine (bytes, or sizes such as '24GiB'); the
    rates stay this machine's. host_mem sets both total and available RAM."""
    host, gpu = profile.host, profile.gpu
    if host_mem is not None:
        n = size_bytes(host_mem, "--host-mem")
        host = dataclasses.replace(host, ram_bytes=n, ram_available_bytes=n)
    if gpu_mem is not None:
        if gpu is None:
            raise UsageError("--gpu-mem: the hardware profile has no GPU to resize (JAX saw none where it was "
                             "measured); probe a machine with the GPU (stratac probe-hw)")
        gpu = dataclasses.replace(gpu, memory_bytes=size_bytes(gpu_mem, "--gpu-mem"))
    return dataclasses.replace(profile, host=host, gpu=gpu)


def size_bytes(value: int | str, flag: str) -> int:
    """An int, or a size such as '16GiB' / '800MB' (passes.laq.parse_size), as bytes; `flag` names
    the option in the error."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise UsageError(f"{flag} {value}: must be positive")
        return value
    from .passes.laq import parse_size

    try:
        return parse_size(str(value))
    except UsageError:
        raise UsageError(f"{flag} {value!r}: use a size such as 800MiB, 12GB or 16GiB") from None


# ------------------------------------------------------------------------------------------------
# measuring


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
    from .backends.xla.device import gpus

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

    from .backends.llvm_cpu.pool import ThreadPool, default_threads
    from .backends.llvm_cpu.target import Target

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
    total, available = _meminfo()
    op_s = None
    gemv: dict[str, float] = {}
    flops: dict[str, float] = {}
    M, N, K = sizes.matmul
    say(f"host: memory read bandwidth ({sizes.read_bytes / 2**20:.0f} MiB, {threads} threads)")
    if target is None:
        read_bw = _numpy_read_bandwidth(sizes.read_bytes, sizes.reps)
    else:
        from .backends.llvm_cpu.jit import library

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
    from .backends.llvm_cpu.codegen.common import KernelSource, fn_attrs, load_args

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
    from .backends.llvm_cpu.codegen.dot import needs_q8
    from .backends.llvm_cpu.codegen.elementwise import quantize_q8
    from .backends.llvm_cpu.codegen.linear import PARAMS, LinearSpec, generate

    block, G = _weight_block(fmt, K)
    arrays = {k: np.resize(a, (N,) + a.shape[1:]) for k, a in block.items()}
    q8 = needs_q8(fmt, G) if q8 is None else q8
    w, s = arrays.get("qs", arrays.get("w")), arrays.get("scales")
    x = np.random.default_rng(1).standard_normal((M, K), dtype=np.float32)
    ng = -(-K // 32)
    xq, xd, xs = np.zeros((M, ng * 32), np.int8), np.zeros((M, ng), np.float32), np.zeros((M, ng), np.int32)
    if q8:
        from .backends.llvm_cpu.codegen.dot import pair_layout

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


def _meminfo() -> tuple[int, int]:
    """(total, available) RAM in bytes: /proc/meminfo, capped by the cgroup's memory limit."""
    info: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                info[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = info.get("MemAvailable", total)
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
        break
    return total, min(available, total)


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

    from .backends.xla.executor import matvec
    from .ir import WeightSpec

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
    h2d_pinned = None
    try:
        from jax.sharding import SingleDeviceSharding

        pinned = sync(jax.device_put(host, SingleDeviceSharding(dev, memory_kind="pinned_host")))
        on_dev = SingleDeviceSharding(dev, memory_kind="device")
        h2d_pinned = host.nbytes / _median_seconds(lambda: sync(jax.device_put(pinned, on_dev)), reps)
        del pinned
    except Exception as e:      # noqa: BLE001 - any failure of this optional API only loses the figure
        msg = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
        notes.append(f"gpu: no pinned host->device figure (JAX: {type(e).__name__}{': ' + msg if msg else ''})")
    times = []
    for i in range(reps + 1):
        y = sync(scale(x))          # a fresh array each time: device_get caches the host copy on it
        t0 = time.perf_counter()
        jax.device_get(y)
        times.append(time.perf_counter() - t0)
        del y
    d2h = host.nbytes / statistics.median(times[1:])
    tiny = jax.jit(lambda x, pos: (x * 2.0 + 1.0, pos + 1))
    xin = np.ones((1, 2048), np.float32)
    from strata_compiler.backends.xla import cuda_rt

    if cuda_rt.enable(dev.platform):   # the runtime's own hand-off: raw copies through staging arrays
        say("gpu: partition round trip (a tiny jitted call, raw copies in and out)")
        st, xout = cuda_rt.Staging(dev), np.empty((1, 2048), np.float32)

        def trip():
            y = tiny(st.stage(0, xin), st.stage(1, np.asarray(3, np.int32)))[0]
            st.guard = y
            cuda_rt.fetch_into(y, xout)
        part_s = _median_seconds(trip, max(20, reps), warmup=3)
    else:
        say("gpu: partition round trip (a tiny jitted call, NumPy in and out)")
        part_s = _median_seconds(lambda: np.asarray(tiny(xin, np.int32(3))[0]), max(20, reps), warmup=3)
    return GpuProfile(name=name, memory_bytes=memory, copy_bandwidth=copy_bw, gemv=gemv, matmul_flops=mm_flops,
                      h2d_pageable=h2d, h2d_pinned=h2d_pinned, d2h=d2h, partition_seconds=part_s)


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


# ------------------------------------------------------------------------------------------------
# reporting


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


def describe(p: HardwareProfile) -> str:
    """A compact human table of a profile."""
    h = p.host
    gib = 2 ** 30
    isa = [k for k, on in dataclasses.asdict(h.isa).items() if on]
    lacks = [k for k in ("avx512f", "avx512_vnni", "amx") if not getattr(h.isa, k)]
    lines = [f"measured {p.measured_at}{' (--quick: rough figures)' if p.quick else ''}, "
             f"strata {p.software.get('strata', '?')}",
             f"host  {h.cpu} ({h.llvm_cpu}): {h.cores} cores, measured on {h.threads} threads; "
             f"{' '.join(isa) or 'no vector extensions'}{'; no ' + ', '.join(lacks) if lacks else ''}",
             f"      RAM {h.ram_bytes / gib:.1f} GiB, {h.ram_available_bytes / gib:.1f} GiB available; "
             f"read bandwidth {h.read_bandwidth / GB:.1f} GB/s"]
    if p.gpu is None:
        lines.append("gpu   none visible to JAX")
    else:
        g = p.gpu
        pinned = f"{g.h2d_pinned / GB:.1f} GB/s pinned" if g.h2d_pinned else "pinned n/a"
        lines += [f"gpu   {g.name}: {g.memory_bytes / gib:.1f} GiB; copy {g.copy_bandwidth / GB:.0f} GB/s; "
                  f"bf16 matmul {g.matmul_flops / 1e12:.1f} TFLOP/s",
                  f"      host->device {g.h2d_pageable / GB:.1f} GB/s pageable, {pinned}; "
                  f"device->host {g.d2h / GB:.1f} GB/s"]
    d = p.disk
    lines.append(f"disk  {d.path} ({d.filesystem or '?'}): read {d.read_bandwidth / GB:.2f} GB/s "
                 f"({d.test_bytes / 2**20:.0f} MiB{', page cache dropped' if d.cache_dropped else ''})")
    fmts = list(FORMATS)
    rows = [("cpu GEMV GB/s", h.gemv, GB), (f"cpu matmul GFLOP/s ({h.matmul_tokens} tok)", h.matmul_flops, 1e9)]
    if p.gpu is not None:
        rows.append(("gpu GEMV GB/s", p.gpu.gemv, GB))
    width = max(len(r[0]) for r in rows)
    lines.append("")
    lines.append(f"{'format':{width}s} " + " ".join(f"{f:>7s}" for f in fmts))
    for label, rates, unit in rows:
        lines.append(f"{label:{width}s} " + " ".join(f"{rates[f] / unit:7.1f}" if f in rates else f"{'-':>7s}"
                                                     for f in fmts))
    for n in p.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)
