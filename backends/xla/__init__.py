"""The XLA backend: kernel-level partitions lowered to jitted JAX functions (CUDA or JAX-CPU)."""
