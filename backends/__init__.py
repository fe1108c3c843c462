"""Backends: `reference` (NumPy oracle), `llvm` (CPU JIT kernels), `xla` (JAX: CUDA, or JAX-CPU).

This package level names the backends and picks one for a host; backends/probe.py measures the
host with them. Each backend imports only the ground (strata_compiler/) and its own modules (the
xla backend's host calls also run the llvm backend's kernels); tests/test_layering.py checks it.
"""

from __future__ import annotations

from strata_compiler.errors import BackendError

BACKENDS = ("reference", "llvm", "xla")


def llvm_available() -> tuple[bool, str]:
    """Whether this host can run the llvm backend, and why not."""
    try:
        from .llvm_cpu.target import Target

        Target.host()
        return True, ""
    except BackendError as e:
        return False, str(e)
    except ImportError as e:   # llvmlite missing
        return False, f"llvmlite is not importable ({e})"


def resolve_backend(name: str) -> str:
    """The backend a run uses for `--backend name` on this host."""
    if name == "auto":
        from .xla.device import cuda_device_count, gpu_available

        if cuda_device_count() and gpu_available():     # (the driver first: JAX is imported only for a GPU)
            return "xla"
        return "llvm" if llvm_available()[0] else "reference"
    if name == "reference":
        return name
    if name == "llvm":
        ok, why = llvm_available()
        if not ok:
            raise BackendError(f"--backend llvm: {why}")
        return name
    if name == "xla":
        from .xla.device import load_jax

        load_jax()
        return name
    raise BackendError(f"--backend {name}: unknown backend; choose one of reference, llvm, xla, auto")


def make_executor(backend: str, graph, weights, device: str = "auto"):
    """An executor running every node of a kernel-level graph on one backend:
    `.run(input_ids i64[B,T], cache) -> {output id: array}`. (A plan placed over several backends
    runs through the runtime's MixedExecutor, runtime/partitions.py.)"""
    if backend == "xla":
        from .xla.executor import XLAExecutor

        return XLAExecutor(graph, weights, device_kind=device)
    if backend == "llvm":
        from .llvm_cpu.executor import LLVMExecutor

        return LLVMExecutor(graph, weights)
    from .reference.executor import ReferenceExecutor

    return ReferenceExecutor(graph, weights)
