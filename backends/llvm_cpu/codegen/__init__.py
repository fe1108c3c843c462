"""LLVM IR generators, one module per kernel family. Each returns a `KernelSource`."""
