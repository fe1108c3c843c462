"""Backends: `reference` (NumPy oracle), `llvm` (CPU JIT); `xla` (JAX) arrives in a later issue."""

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
        return "llvm" if llvm_available()[0] else "reference"
    if name == "reference":
        return name
    if name == "llvm":
        ok, why = llvm_available()
        if not ok:
            raise BackendError(f"--backend llvm: {why}")
        return name
    if name == "xla":
        raise BackendError("--backend xla: this backend is not built yet; use --backend llvm or reference (or auto)")
    raise BackendError(f"--backend {name}: unknown backend; choose one of reference, llvm, xla, auto")


def make_executor(backend: str, graph, weights):
    """An executor for a kernel-level graph: `.run(input_ids i64[B,T], cache) -> {output id: array}`."""
    if backend == "llvm":
        from .llvm_cpu.executor import LLVMExecutor

        return LLVMExecutor(graph, weights)
    from .reference.executor import ReferenceExecutor

    return ReferenceExecutor(graph, weights)
