"""The pieces a step of the llvm executor is made of: compiled kernels and their argument arrays,
the buffers of one step shape (a Frame), the q8 activation quantizer, and the instructions of a
segment program (pool.ll `strata_run_program`: a CPU partition's ops as one native call).

Legend: B batch, T tokens per sequence, M = B*T.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from strata_compiler.ir import Graph, Node
from strata_compiler.kv_cache import KVCache

from .codegen import elementwise as ew
from .codegen.common import KernelSource
from .codegen.dot import Q8_BLOCK

if TYPE_CHECKING:
    from strata_compiler.experts import Residency

    from .pool import ThreadPool
    from .target import Target

# Segment programs: each op's step function may carry `native(step) -> [instruction]` (built once
# per step shape) and `pre(step)` (Python run before the program every step: per-step argument
# values); run_segment runs the program where every op of the range has one. An instruction is
# 10 int64s; its kinds and fields are documented at `strata_run_program` in pool.ll.
PAR, ONE, SET, COPY, GATHER, TSC, MASK = range(7)


def ins(kind: int, fn: int = 0, args: int = 0, f3: int = 0, src: int = 0, f5: int = 0, f6: int = 0,
        dst: int = 0, f8: int = 0, f9: int = 0) -> tuple:
    return (kind, fn, args, f3, src, f5, f6, dst, f8, f9)


def step_fn(run: Callable, native: Callable | None, pre: Callable | None = None) -> Callable:
    """Step function `run`, marked with its native form (see above)."""
    run.native, run.pre = native, pre
    return run


class KernelAddresses(Protocol):
    """Where a kernel's address comes from: jit.py's KernelLibrary (compiles it), or executor.py's
    SourceCollector (only lists the kernels a graph needs)."""

    def address(self, ir_text: str, name: str) -> int: ...


class ExecutorView(Protocol):
    """What binders (binders.py), frames and quantizers read of the executor they work for
    (executor.py's LLVMExecutor, which imports them: declared here, they need not import it)."""

    g: Graph
    w: object                   # the plan's weights (runtime/plan.py), or a test's stand-in
    lib: KernelAddresses
    target: Target
    pool: ThreadPool
    act: str                    # activations: "q16", "q8" or "f32"
    planes: int                 # planes of int8 codes per activation block
    residency: Residency        # a mixed run's live expert caches

    def weight(self, name: str | None) -> tuple[np.ndarray | None, np.ndarray | None]: ...

    def q8(self, K: int, fmt: str = "", group_size: int = 0) -> Q8: ...


class Kernel:
    """A compiled kernel and the positions of its argument slots."""

    def __init__(self, lib: KernelAddresses, src: KernelSource) -> None:
        self.src = src
        self.addr = lib.address(src.ir, src.name)
        self.index = {p: i for i, p in enumerate(src.params)}

    def args(self, **vals) -> "Args":
        return Args(self, vals)


class Args:
    """A kernel's argument array, built once per step shape; per-step values are set in place."""

    def __init__(self, kernel: Kernel, vals: dict) -> None:
        self.kernel = kernel
        self.arr = (ctypes.c_int64 * len(kernel.src.params))(*[_slot(vals.get(p)) for p in kernel.src.params])
        self.addr = ctypes.addressof(self.arr)

    def set(self, **vals) -> "Args":
        for k, v in vals.items():
            self.arr[self.kernel.index[k]] = _slot(v)
        return self

    def go(self, pool, total: int, min_chunk: int = 1) -> None:
        pool.parallel_for(self.kernel.addr, self.addr, total, min_chunk=min_chunk)

    def par(self, total: int, min_chunk: int = 1, src: int = 0, mult: int = 0) -> tuple:
        """The program instruction of go(): over total (+ *src * mult, a count a kernel wrote) items."""
        return ins(PAR, self.kernel.addr, self.addr, total, src, mult, min_chunk)

    def slot(self, name: str) -> int:
        """Address of argument slot `name` (a program's SET writes there)."""
        return self.addr + 8 * self.kernel.index[name]

    def go_op(self, pool, total: int, min_chunk: int = 1) -> Callable:
        """A step function that runs go(total), with its native form."""
        return step_fn(lambda step: self.go(pool, total, min_chunk=min_chunk),
                       lambda step: [self.par(total, min_chunk)])


def ld(a: np.ndarray) -> int:
    """Row stride in elements (views of padded scratch have rows longer than their width)."""
    return a.strides[0] // a.itemsize


def _slot(v) -> int:
    if v is None:
        return 0
    if isinstance(v, np.ndarray):
        return v.ctypes.data
    return int(v)


#: An env value meaning "already in this executor's frame buffer" (a fused step's host call copied
#: it there from the GPU): run_segment does not fetch it.
IN_FRAME = object()


class Frame:
    """Buffers for one step shape (M tokens): plan-memory's slots for node results, shared scratch."""

    def __init__(self, exe: ExecutorView, M: int) -> None:
        self.M = M
        self.exe = exe
        self.slots: dict[int, np.ndarray] = {}
        self.scratch: dict[tuple, np.ndarray] = {}
        self.ids = np.zeros(M, np.int64)

    def out(self, n: Node) -> np.ndarray:
        """The f32[M, C] result of node n, in its plan-memory buffer."""
        C = n.type.shape[-1]
        if n.buffer not in self.slots:
            self.slots[n.buffer] = np.zeros(self.M * n.type.bytes_per_token() // 4, np.float32)
        return self.slots[n.buffer][: self.M * C].reshape(self.M, C)

    def temp(self, key: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """Scratch live only within one op, shared by every op of the step that asks the same key."""
        k = (key, shape, np.dtype(dtype).str)
        if k not in self.scratch:
            self.scratch[k] = np.zeros(shape, dtype)
        return self.scratch[k]


@dataclass
class Step:
    """What one forward step needs: token counts and the cache; `phases`, where a benchmark collects
    the MoE op's phase times (LLVMExecutor.phase_ns)."""

    B: int
    T: int
    cache: KVCache
    phases: dict[str, list[int]] | None = None

    @property
    def M(self) -> int:
        return self.B * self.T


class Q8:
    """Quantizes f32 rows of width K to q8 blocks (int8 data, f32 scales, i32 block sums)."""

    def __init__(self, exe: ExecutorView, K: int, pairs: bool = False, planes: int = 1) -> None:
        self.K, self.pairs, self.planes = K, pairs, planes
        self.ng = -(-K // Q8_BLOCK)
        self.kernel = Kernel(exe.lib, ew.quantize_q8(K, exe.target, pairs, planes))

    def prepare(self, frame: Frame, x: np.ndarray, key: str, rows: int | None = None):
        """Scratch (xq, xd, xs) for x's rows and a function that fills them. `rows` > x's: the
        scratch has that many, the ones past x's staying zero (scale 0: AMX tiles' padding)."""
        M = x.shape[0]
        R = max(M, rows or 0)
        key += ".p" if self.pairs else ""     # the two layouts of one input are separate scratch
        xq = frame.temp(key + ".q", (R, self.planes * self.ng * Q8_BLOCK), np.int8)
        xd = frame.temp(key + ".d", (R, self.ng), np.float32)
        xs = frame.temp(key + ".s", (R, self.ng), np.int32)
        a = self.kernel.args(x=x, xq=xq, xd=xd, xs=xs, ldx=ld(x))
        pool = frame.exe.pool

        def run(rows: int = M) -> None:
            a.go(pool, rows, min_chunk=4)
        run.args = a            # for programs: a.par(rows, 4)
        return (xq, xd, xs), run
