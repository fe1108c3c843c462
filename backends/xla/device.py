"""Which JAX device runs the xla backend, and JAX's persistent compilation cache.

JAX asked for a platform it does not have fails with a bare error (or an AssertionError deep
inside); Strata asks `jax.devices()` itself and says in one line what is missing.
"""

from __future__ import annotations

import functools

from strata_compiler import settings
from strata_compiler.errors import BackendError


@functools.cache
def load_jax():
    # JAX's GPU client reserves 75 % of the device's memory at its first allocation unless told
    # not to: on a 141 GB H200 that alone is ~1.4 s of a fresh process's first token. Its pool
    # grows as needed instead (the `gpu_preallocate` setting restores JAX's default).
    settings.jax_client_env()
    try:
        import jax
    except ImportError as e:   # pragma: no cover - jax is a dependency
        raise BackendError(f"the xla backend needs JAX, which does not import here ({e})") from None
    # Compiled executables persist across runs: a second run on the same host compiles nothing.
    jax.config.update("jax_compilation_cache_dir", str(settings.cache_root() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return jax


def on_device(a) -> bool:
    """Whether a KV cache array is a JAX array, not a host NumPy one (`hasattr(a, "device")` cannot
    tell: NumPy 2's arrays have a `device` too)."""
    return isinstance(a, load_jax().Array)


def zeros_all(specs, device) -> list:
    """Zero arrays of these (shape, dtype) pairs made on `device` by one program: a plan's weights
    get their device buffers from one compiled program and one launch, not one per shape (jnp.zeros
    with a device fills the array on the host and copies it over: seconds for a plan's weights)."""
    import numpy as np

    key = tuple((tuple(int(d) for d in shape), np.dtype(dtype)) for shape, dtype in specs)
    return list(_zeros_all_fn(key, device)()) if key else []


@functools.cache
def _zeros_all_fn(specs: tuple, device):
    jax = load_jax()
    import jax.numpy as jnp

    return jax.jit(lambda: tuple(jnp.zeros(s, d) for s, d in specs),
                   out_shardings=tuple(jax.sharding.SingleDeviceSharding(device) for _ in specs))


@functools.cache
def cuda_device_count() -> int:
    """CUDA devices this process may use, asked of the driver (libcuda: honours
    CUDA_VISIBLE_DEVICES) without importing JAX: `--backend auto` on a host without a GPU never
    pays JAX's import. (A count > 0 is then confirmed by JAX itself: `gpu_available`.)"""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


_started: list = []


def start_in_background() -> None:
    """Import JAX and bring its GPU backend up on a daemon thread (once), where the driver sees a
    CUDA GPU: a run bound for the xla backend reads its plan meanwhile instead of waiting first.
    Later calls of `load_jax`/`gpus` wait for it (the import lock, the backend's own lock)."""
    if _started:
        return
    import threading

    def warm() -> None:
        try:
            if cuda_device_count():
                gpus()
        except Exception:       # noqa: BLE001 - the main thread meets and reports the same failure
            pass

    t = threading.Thread(target=warm, name="strata-jax-start", daemon=True)
    _started.append(t)
    t.start()


def gpus() -> list:
    jax = load_jax()
    try:
        return [d for d in jax.devices() if d.platform in ("gpu", "cuda", "rocm")]
    except RuntimeError:
        return []


def gpu_available() -> bool:
    return bool(gpus())


def device(kind: str = "auto", index: int = 0):
    """The device for xla partitions: a GPU when present (or required), else JAX's CPU; `index`
    picks among several (a plan's gpu:N). JAX's CPU platform stands in with as many devices as
    XLA_FLAGS=--xla_force_host_platform_device_count gives it."""
    jax = load_jax()
    if kind in ("auto", "gpu"):
        g = gpus()
        if g:
            if index >= len(g):
                raise BackendError(f"the plan uses GPU {index}; JAX sees {len(g)} GPU(s) here")
            return g[index]
        if kind == "gpu":
            raise BackendError("--backend xla on a GPU: no CUDA GPU is visible to JAX here "
                               "(is jax installed with CUDA support, and a GPU present?); use --backend llvm")
    cpus = jax.devices("cpu")
    if index >= len(cpus):
        raise BackendError(f"the plan uses GPU {index}; JAX's CPU platform stands in with {len(cpus)} device(s) "
                           f"(set XLA_FLAGS=--xla_force_host_platform_device_count={index + 1})")
    return cpus[index]
