"""The LLVM CPU backend: kernels generated as LLVM IR, JIT-compiled for the host with llvmlite."""
