"""The compile pipelines, each pass one line. The manager verifies the IR after every pass."""

from __future__ import annotations

# Importing the pass modules registers them.
from strata_compiler.passes import (calibrate, cluster_experts, cpu_codegen, emit, fuse, lower,  # noqa: F401
                                    place, plan_memory, quantize, select_kernels)

DEFAULT = [
    "lower",           # graph -> tensor: attention, mlp and moe become primitive tensor ops
    "fuse",            # QKV / gate-up merges, SiLU*mul, attention, router, norm prologues, residuals
    "calibrate",       # --calib: input statistics per weight and routing per expert, from real text
    "cluster-experts", # --calib: each MoE layer's experts grouped by co-activation (swap units)
    "quantize",        # weight formats from --quant / --group-size; fused weights share one
    "place",           # --target: GPU or CPU per op and per expert from a cost model and a hardware profile
    "select-kernels",  # tensor -> kernel: bind every op to a device and a backend
    "plan-memory",     # activation buffers by liveness; peak activation bytes per token
    "cpu-codegen",     # LLVM IR for every CPU kernel, compiled into the kernel cache (+ IR/asm dumps)
    "emit",            # write plan.bin and weights.bin
]
