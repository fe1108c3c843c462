"""Raw copies for the small hand-offs between GPU partitions and CPU kernels.

A decode step of a plan that splits layers between the devices crosses between them about twice
per layer, each time with a few KiB. Through JAX each crossing pays the runtime's thread
hand-offs and a synchronous copy inside the dispatch; libcudart's cudaMemcpy on the buffers JAX
owns (`unsafe_buffer_pointer`), in the calling thread, costs a fraction of that
(benchmarks/gpu_roundtrip.py). So on a CUDA GPU the mixed runtime (when `enable()`d):
- writes each host value a GPU partition reads into a device *staging* array the partition owns
  (`Staging.stage`), and passes that array to the jitted call instead of the NumPy array;
- copies each GPU result a CPU kernel reads straight into the kernel's own buffer (`fetch_into`)
  after waiting for it (`block_until_ready`: JAX's readiness, so never a half-written result).

Ordering: a staging array is rewritten only after the partition's previous run has finished
(its outputs are ready), so no queued computation can still be reading it. Every copy runs on a
non-blocking stream of ours and is synchronised there (`_stream_of`).

Which copies are raw is decided per array, by its platform: a CUDA GPU's arrays by libcudart
where it loads; JAX's CPU arrays by memmove on their buffers where the `raw_copy` setting is
`host` (tests: CI exercises the staging logic); else JAX's own transfers. An executor holds the
decision for its platform as a `Transfers` (staging, uploads, expert-slot writes, page-locking);
nothing here is process-wide but libcudart's handle, its streams and the memo of each sharding's
platform.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from strata_compiler import settings

_LIB = None
_TRIED = False
H2D, D2H = 1, 2


def _find() -> list[str]:
    names = []
    for base in sys.path:
        for pat in ("nvidia/cuda_runtime/lib/libcudart.so*", "nvidia/cu*/lib/libcudart.so*"):
            names += sorted(glob.glob(os.path.join(base, pat)))
    return names + ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]


def lib():
    """The loaded libcudart, or None."""
    global _LIB, _TRIED
    if _TRIED:
        return _LIB
    _TRIED = True
    for name in _find():
        try:
            L = ctypes.CDLL(name)
        except OSError:
            continue
        L.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        L.cudaMemcpy.restype = ctypes.c_int
        L.cudaDeviceSynchronize.restype = ctypes.c_int
        L.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        L.cudaStreamSynchronize.restype = ctypes.c_int
        L.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        L.cudaMemcpyAsync.restype = ctypes.c_int
        L.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        L.cudaStreamCreateWithFlags.restype = ctypes.c_int
        L.cudaSetDevice.argtypes = [ctypes.c_int]
        count = ctypes.c_int(0)
        if L.cudaGetDeviceCount(ctypes.byref(count)) != 0 or count.value < 1:
            break               # a runtime library but no usable GPU (or driver) here
        _LIB = L
        break
    return _LIB


def available() -> bool:
    return lib() is not None


def raw_mode(platform: str) -> str | None:
    """The raw copies of `platform`'s arrays: "cuda" (libcudart), "host" (memmove on JAX's CPU
    arrays, the raw_copy setting's `host`) or None (JAX's own transfers)."""
    if platform == "gpu":
        return "cuda" if available() else None
    return "host" if platform == "cpu" and settings.get("raw_copy") == "host" else None


@dataclass(frozen=True)
class Transfers:
    """How one executor's values cross to and from its device (`raw_mode` of its platform): with
    a mode, host values go through staging arrays and uploads and slot writes are raw copies."""

    mode: str | None = None

    @classmethod
    def of(cls, platform: str) -> "Transfers":
        return cls(raw_mode(platform))

    @property
    def raw(self) -> bool:
        return self.mode is not None

    @property
    def cuda(self) -> bool:
        """Raw copies by libcudart: bulk copies (copy_bulk), page-locking (pin), upload lanes."""
        return self.mode == "cuda"


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what} failed (CUDA error {rc})")


_STREAMS: dict[tuple, ctypes.c_void_p] = {}     # (device, bulk flag) -> stream


@functools.lru_cache(maxsize=256)
def _sharding_info(sh) -> tuple[bool, object, str]:
    """(one device, its copy stream where libcudart copies it, its platform) of a sharding: looked
    up once per sharding object (JAX shares one per device), since x.devices() costs a few Python
    microseconds per copy, as much as the copy of a hidden state itself."""
    devs = sh.device_set
    if len(devs) != 1:
        return False, None, ""
    d = next(iter(devs))
    stream = _stream_of(d) if d.platform == "gpu" and available() else None
    return True, stream, d.platform


def _info(x) -> tuple[bool, object]:
    """(x is a single-device array that raw copies take, its copy stream or None: memmove)."""
    sh = getattr(x, "sharding", None)
    if sh is None or not hasattr(x, "unsafe_buffer_pointer"):
        return False, None
    try:
        one, stream, platform = _sharding_info(sh)
    except TypeError:                   # a sharding that does not hash: looked up each time
        one, stream, platform = _sharding_info.__wrapped__(sh)
    if stream is not None:
        return True, stream
    return one and raw_mode(platform) == "host", None


def _stream_of(d, bulk: bool = False):
    """A non-blocking CUDA stream of device d for the raw copies; `bulk`: a second one, for the
    expert-cache copies queued without waiting (to_device(wait=False)).

    cudaMemcpy on the legacy default stream would also wait for the work queued on XLA's stream,
    though the copy's source is known ready, which serialises the two devices. A stream of our
    own, synchronised after each copy, waits for nothing else. That is safe because every raw
    copy is ordered explicitly: a device->host copy waits for its source (`fetch`, `fetch_into`),
    a staging rewrite for the partition's previous call (`Staging.guard`), an expert-slot write
    for the last call that read the slot's weights (`XLAExecutor.set_slot`)."""
    dev = int(getattr(d, "local_hardware_id", None) or d.id)
    return _stream((dev, bulk))     # bulk copies on a stream of their own: a hand-off never waits behind them


def _stream(key: tuple) -> ctypes.c_void_p:
    """The non-blocking stream of device key[0] kept under `key`, made on first use."""
    s = _STREAMS.get(key)
    if s is None:
        L = _LIB
        prev = ctypes.c_int(0)
        _check(L.cudaGetDevice(ctypes.byref(prev)), "cudaGetDevice")
        _check(L.cudaSetDevice(key[0]), "cudaSetDevice")
        s = ctypes.c_void_p()
        try:
            _check(L.cudaStreamCreateWithFlags(ctypes.byref(s), 1), "cudaStreamCreateWithFlags")   # non-blocking
        finally:
            L.cudaSetDevice(prev.value)
        _STREAMS[key] = s
    return s


def _copy(dst: int, src: int, n: int, kind: int, s) -> None:
    """A raw copy on stream s that has landed when this returns."""
    _check(_LIB.cudaMemcpyAsync(dst, src, n, kind, s), "cudaMemcpyAsync")
    _check(_LIB.cudaStreamSynchronize(s), "cudaStreamSynchronize")


def to_host(x, out: np.ndarray) -> None:
    """Copy finished device array x into NumPy array `out` (C-contiguous, x's byte size)."""
    s = _info(x)[1]
    if s is not None:
        _copy(out.ctypes.data, x.unsafe_buffer_pointer(), out.nbytes, D2H, s)
    else:
        ctypes.memmove(out.ctypes.data, x.unsafe_buffer_pointer(), out.nbytes)


def to_device(src: np.ndarray, x, offset: int = 0, wait: bool = True) -> None:
    """Overwrite device array x's buffer from byte `offset` with `src` (C-contiguous, fits); the
    caller makes sure nothing reads x meanwhile. Returns when the copy has landed, or with
    wait=False (bulk copies: expert-cache slots) as soon as it is queued on the device's bulk
    stream: `wait_bulk()` must then run before anything reads x. (`src` may be reused at once
    either way: a copy from pageable memory is staged before the call returns, and pinned memory
    is the plan's own mapping, which outlives the copy.)"""
    if offset < 0 or offset + src.nbytes > x.nbytes:
        raise ValueError(f"a copy of {src.nbytes} B at offset {offset} does not fit an array of {x.nbytes} B")
    dst = x.unsafe_buffer_pointer() + offset
    s = _info(x)[1]
    if s is None:
        ctypes.memmove(dst, src.ctypes.data, src.nbytes)
        return
    if wait:
        _copy(dst, src.ctypes.data, src.nbytes, H2D, s)
        return
    s = _stream_of(next(iter(x.devices())), bulk=True)
    _check(_LIB.cudaMemcpyAsync(dst, src.ctypes.data, src.nbytes, H2D, s), "cudaMemcpyAsync")
    _PENDING[s.value] = s


_PENDING: dict[int, ctypes.c_void_p] = {}     # bulk streams with copies not yet waited for


def upload(pairs, workers: int | None = None) -> None:
    """Copy each (host array, device array) pair's bytes (equal sizes) on `workers` threads, each
    on a stream of its own; returns when all have landed. Nothing may read the device arrays
    meanwhile, and whatever initialised them must have finished. A copy from pageable memory is
    staged by the calling thread's memcpy, so threads add up to several times one's rate."""
    pairs = [(np.ascontiguousarray(h), x) for h, x in pairs]
    for h, x in pairs:
        if h.nbytes != x.nbytes:
            raise ValueError(f"an upload of {h.nbytes} B into a device array of {x.nbytes} B")
    if not pairs or _info(pairs[0][1])[1] is None:
        for h, x in pairs:
            to_device(h, x)
        return
    workers = max(1, min(workers or min(8, os.cpu_count() or 1), len(pairs)))
    lanes: list[list] = [[] for _ in range(workers)]
    for h, x in sorted(pairs, key=lambda p: -p[0].nbytes):      # largest first, each to the lightest lane
        min(lanes, key=lambda ln: sum(p[0].nbytes for p in ln)).append((h, x))

    def run(i: int) -> None:
        if not lanes[i]:
            return
        dev = int(getattr(next(iter(lanes[i][0][1].devices())), "local_hardware_id", None) or 0)
        s = _stream((dev, "upload", i))
        for h, x in lanes[i]:
            _check(_LIB.cudaMemcpyAsync(x.unsafe_buffer_pointer(), h.ctypes.data, h.nbytes, H2D, s), "cudaMemcpyAsync")
        _check(_LIB.cudaStreamSynchronize(s), "cudaStreamSynchronize")

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(run, range(workers)))


def copy_bulk(dst: int, src: int, n: int, x) -> None:
    """n bytes from host address `src` (pinned memory that outlives the copy) to device address
    `dst` inside device array x, queued on the bulk stream of x's device as to_device(wait=False)
    queues them (`wait_bulk()` before anything reads x): an expert-cache swap from its copy plan,
    without building arrays per copy. Only where libcudart copies (Transfers.cuda)."""
    s = _stream_of(next(iter(x.devices())), bulk=True)
    _check(_LIB.cudaMemcpyAsync(dst, src, n, H2D, s), "cudaMemcpyAsync")
    _PENDING[s.value] = s


def wait_bulk() -> None:
    """Wait for every copy started with to_device(..., wait=False)."""
    while _PENDING:
        _, s = _PENDING.popitem()
        _check(_LIB.cudaStreamSynchronize(s), "cudaStreamSynchronize")


_PINNED: list[tuple[int, int]] = []     # page ranges registered with cudaHostRegister


def pin(arrays) -> int:
    """Page-lock the host memory under `arrays` (cudaHostRegister, read-only) so that copies from
    it run at the pinned rate (several times the pageable one) and without a staging copy on the
    host. Page ranges are merged first (neighbouring arrays share
    pages; a range registered twice is an error). Returns the bytes pinned; 0 without a CUDA
    runtime, and whatever fails to register stays pageable. Registrations last as long as the
    process (the driver holds the pages), so pin only memory that lives as long: the plan's
    weight mapping of a session. The pages are mapped into the GPUs' address space too
    (runtime/mapped.py reads them in place)."""
    if lib() is None:
        return 0
    import mmap

    from strata_compiler.trace import merged

    page = mmap.PAGESIZE
    ranges = merged((a.ctypes.data // page * page, -(-(a.ctypes.data + a.nbytes) // page) * page)
                    for a in arrays if a.nbytes)
    L = _LIB
    if not hasattr(L, "_host_register_typed"):
        L.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        L.cudaHostRegister.restype = ctypes.c_int
        L.cudaGetLastError.restype = ctypes.c_int
        L._host_register_typed = True
    done = 0
    for lo, hi in ranges:
        if any(lo < b and a < hi for a, b in _PINNED):
            continue                     # overlaps a range pinned earlier: leave it pageable
        if L.cudaHostRegister(lo, hi - lo, 1 | 2 | 8) == 0:     # Portable | Mapped (device_view) | ReadOnly
            _PINNED.append((lo, hi))
            done += hi - lo
        else:
            L.cudaGetLastError()         # clear the (non-sticky) error
    return done


def sync() -> None:
    _check(_LIB.cudaDeviceSynchronize(), "cudaDeviceSynchronize")


def copy_stream(device) -> ctypes.c_void_p:
    """A non-blocking stream of `device` for copies the caller orders itself (streaming.py)."""
    dev = int(getattr(device, "local_hardware_id", None) or device.id)
    return _stream((dev, "weights"))


def stream_sync(s: ctypes.c_void_p) -> None:
    _check(_LIB.cudaStreamSynchronize(s), "cudaStreamSynchronize")


def copy_async(dst: int, src: int, n: int, stream: int) -> None:
    """A host->device copy of n bytes queued on `stream` (raw addresses; the caller orders it)."""
    _check(_LIB.cudaMemcpyAsync(dst, src, n, H2D, ctypes.c_void_p(stream)), "cudaMemcpyAsync")


def fetch_into(v, dst: np.ndarray) -> bool:
    """GPU result v into `dst` (same number of elements) by a raw copy when that applies (same
    dtype, `dst` contiguous); False when the caller must copy it itself."""
    if not _info(v)[0] or dst.dtype != v.dtype or dst.size != v.size or not dst.flags.c_contiguous:
        return False
    v.block_until_ready()
    to_host(v, dst)
    return True


def fetch(v) -> np.ndarray:
    """v as a NumPy array: a raw copy for a single-device array raw copies take, else np.asarray."""
    if isinstance(v, np.ndarray) or not _info(v)[0]:
        return np.asarray(v)
    out = np.empty(v.shape, v.dtype)
    v.block_until_ready()
    to_host(v, out)
    return out


class Staging:
    """One xla partition's device staging arrays for host values (by key: node id, "ids", "pos"),
    rewritten in place before each call; `guard` is an output of the partition's previous call,
    waited on before any rewrite."""

    def __init__(self, device) -> None:
        self.device = device
        self.bufs: dict = {}
        self.guard = None
        self.bytes, self.seconds = 0, 0.0     # raw host->device copies so far (the trace's h2d spans)
        self.last_end_ns = 0

    def stage(self, key, value: np.ndarray, write: bool = True):
        """The staging array of `key`, holding `value`; with write=False (the callee ignores the
        value) an existing array of its shape is returned unchanged."""
        import jax

        value = np.require(value, requirements="C")     # (ascontiguousarray would make a 0-d array 1-d)
        buf = self.bufs.get(key)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            buf = jax.block_until_ready(jax.device_put(np.zeros(value.shape, value.dtype), self.device))
            self.bufs[key] = buf
        elif not write:
            return buf
        if self.guard is not None:
            self.guard.block_until_ready()
            self.guard = None
        t0 = time.perf_counter()
        to_device(value, buf)
        self.seconds += time.perf_counter() - t0
        self.bytes += value.nbytes
        self.last_end_ns = time.perf_counter_ns()
        return buf
