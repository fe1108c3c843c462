"""Backends: `reference` (NumPy oracle); `llvm` (CPU JIT) and `xla` (JAX) arrive in later issues."""

from __future__ import annotations

from strata_compiler.errors import BackendError

BACKENDS = ("reference", "llvm", "xla")


def resolve_backend(name: str) -> str:
    """The backend a run uses for `--backend name` on this host."""
    if name == "auto":
        return "reference"
    if name == "reference":
        return name
    if name in BACKENDS:
        raise BackendError(f"--backend {name}: this backend is not built yet; use --backend reference (or auto)")
    raise BackendError(f"--backend {name}: unknown backend; choose one of reference, llvm, xla, auto")
