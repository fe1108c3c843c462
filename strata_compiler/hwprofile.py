"""The hardware profile: how much a machine holds, and how fast it streams and multiplies weights.

The data model of `stratac probe-hw -o hw.json`: the probes that measure it are the backends'
(backends/probe.py, which says how each figure is measured); the placement pass reads a profile
back (`HardwareProfile.from_json`) and asks it how long things take (`cpu_gemv_seconds`,
`gpu_gemv_seconds`, `h2d_seconds`, `disk_seconds`, ...). `override` swaps in the memory sizes of
another machine, to plan for it from a profile of this one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
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
    threads: int               # threads the measurements ran on (the num_threads setting, else the usable CPUs)
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
    """An int, or a size such as '16GiB' / '800MB' (parse_size), as bytes; `flag` names the option
    in the error."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise UsageError(f"{flag} {value}: must be positive")
        return value
    try:
        return parse_size(str(value))
    except UsageError:
        raise UsageError(f"{flag} {value!r}: use a size such as 800MiB, 12GB or 16GiB") from None


def parse_size(text: str) -> int:
    """'16GiB', '800MB', '123456' -> bytes."""
    t = text.strip()
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}
    i = len(t)
    while i > 0 and not (t[i - 1].isdigit() or t[i - 1] == "."):
        i -= 1
    num, unit = t[:i], t[i:].strip().lower()
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if value <= 0 or unit not in units:
        raise UsageError(f"--memory-budget {text!r}: use a size such as 800MiB, 12GB or 16GiB")
    return int(value * units[unit])


def host_memory() -> tuple[int, int]:
    """(total, available) RAM of this host in bytes: /proc/meminfo, capped by the cgroup's memory
    limit (the probe records it; the runtime bounds its default context by it)."""
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
