"""Backends: `reference` (NumPy oracle), `llvm` (CPU JIT kernels), `xla` (JAX: CUDA, or JAX-CPU)."""

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
        from .xla.device import gpu_available

        if gpu_available():
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
        from .xla.device import _jax

        _jax()
        return name
    raise BackendError(f"--backend {name}: unknown backend; choose one of reference, llvm, xla, auto")


def make_executor(backend: str, graph, weights, device: str = "auto", mixed: bool = False,
                  shrink_caches: bool = False, multi_gpu: str = "mesh", miss_path: str = "cpu"):
    """An executor for a kernel-level graph: `.run(input_ids i64[B,T], cache) -> {output id: array}`.

    `mixed`: run each node on the backend the plan bound it to (partitions, see runtime/partitions);
    `shrink_caches`: when the GPU runs out of memory loading them, expert caches get fewer slots;
    `miss_path`: where expert caches' misses compute (runtime/partitions.py MixedExecutor)."""
    if mixed:
        from strata_compiler.runtime.partitions import MixedExecutor

        return MixedExecutor(graph, weights, device, shrink_caches=shrink_caches, multi_gpu=multi_gpu,
                             miss_path=miss_path)
    if backend == "xla":
        from .xla.executor import XLAExecutor

        return XLAExecutor(graph, weights, device_kind=device)
    if backend == "llvm":
        from .llvm_cpu.executor import LLVMExecutor

        return LLVMExecutor(graph, weights)
    from .reference.executor import ReferenceExecutor

    return ReferenceExecutor(graph, weights)
