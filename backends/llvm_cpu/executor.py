"""The LLVM CPU executor: a kernel-level graph run as JIT-compiled kernels on the thread pool.

Binding (once per plan, binders.py) generates and compiles every kernel the graph needs, so
nothing is compiled on the hot path; kernels read weights straight from the plan's arrays (copied
once into huge pages where the OS offers transparent huge pages). A step (prefill chunk or decode)
takes activation buffers from plan-memory's slots, sized for its M = B*T tokens (frame.py), and
runs its ops as one native segment program over the pool; op by op from Python only where that
cannot work or is wanted: while tracing, while the MoE phases are timed (`phase_ns`), with experts
on the disk tier, or where an input must first be fetched from another device.

Activations for int8/int4 weights (groups of 32) are quantized to q8 blocks once per consumer,
so the matrix kernels run on integer dot products (the `cpu_act` setting f32 keeps them f32:
exact, slower). Legend: B batch, T tokens per sequence, M = B*T.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from strata_compiler import settings
from strata_compiler.errors import BackendError
from strata_compiler.execution import WHOLE, Executor, Segment
from strata_compiler.experts import Residency
from strata_compiler.ir import Graph, Node, Op
from strata_compiler import trace
from strata_compiler.kv_cache import KVCache
from strata_compiler.verify import check_token_ids

from .binders import BINDERS
from .codegen.dot import pair_layout
from .frame import IN_FRAME, TSC, Frame, Q8, Step, ins
from .jit import KernelLibrary, library
from .pool import PoolShare, get_pool, pool_split, set_spin
from .target import Target

__all__ = ["LLVMExecutor", "IN_FRAME", "Frame", "Step", "kernel_sources"]


def hugepages_available() -> bool:
    """Whether transparent huge pages are available for madvise'd memory (then the kernels' weights
    are copied into memory backed by 2 MiB pages: fewer TLB misses while they stream)."""
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


class LLVMExecutor(Executor):
    #: a benchmark's (benchmarks/cpu_share.py) timer of the MoE op's phases on this executor: set to
    #: a dict, it collects phase name -> nanoseconds, one per call, and the segment then runs op by
    #: op in Python
    phase_ns: dict[str, list[int]] | None = None

    def __init__(self, graph: Graph, weights, target: Target | None = None, act: str | None = None,
                 lib: "KernelLibrary | SourceCollector | None" = None, nodes: list[int] | None = None,
                 residency: Residency | None = None, fetch_into: Callable | None = None) -> None:
        """residency: a mixed run's live expert caches. fetch_into(value, buffer) -> bool: how the
        runtime copies another device's result into a kernel's buffer (a raw copy; False: it
        cannot, np.asarray then)."""
        self.g = graph
        self.fetch_into = fetch_into
        self.residency = residency if residency is not None else Residency()   # a mixed run's live expert caches
        ids = set(nodes) if nodes is not None else {n.id for n in graph.nodes}
        self.nodes = [n for n in graph.nodes if n.id in ids]
        users = graph.users()
        self.inputs = sorted({a for n in self.nodes for a in n.args if a not in ids})
        # each input is fetched just before the first op that reads it: a GPU result needed only
        # late in the segment (another device's share of a layer, added at its end) is waited for
        # there, so the ops before it run while the GPU is still computing it
        first = {i: next(j for j, n in enumerate(self.nodes) if i in n.args) for i in self.inputs}
        self.fetch_at: list[list[int]] = [[] for _ in self.nodes]
        for i in self.inputs:
            self.fetch_at[first[i]].append(i)
        self.outputs = [n.id for n in self.nodes if any(u == -1 or u not in ids for u in users[n.id])]
        self.w = weights
        self.target = target or Target.host()
        self.lib = lib or library(self.target)
        self.pool = PoolShare(get_pool(), pool_split())   # the setting, read per executor (a mixed plan sets its own)
        self.act = (act or settings.get("cpu_act")).lower()
        if self.act not in ("q16", "q8", "f32"):
            raise BackendError(f"activations {self.act!r}: use q16, q8 or f32")
        self.planes = 2 if self.act == "q16" else 1     # planes of int8 codes per activation block
        self._q8: dict[tuple[int, bool], Q8] = {}
        # the kernels' weights copied into memory backed by 2 MiB pages (runtime/plan.py
        # resident_arrays) where the OS offers transparent huge pages; weights without that method
        # (tests' stand-ins) stay as they are
        self.hugepages = hugepages_available() and hasattr(weights, "resident_arrays")
        # the embedding tables' real row counts: the embed kernel gathers rows by id unchecked
        self.tables = [(self._rows(n.weight("table")), n.weight("table")) for n in self.nodes if n.op is Op.EMBED]
        self.binders = [self._bind(n) for n in self.nodes]   # every kernel compiled here, not per step
        self.frames: dict[int, tuple[Frame, list]] = {}
        # per op, the inputs fetched before it that are values (not the token ids): a program runs
        # only where all of them are already in the frame (a fused step's host call put them there)
        self._fetch_vals = [[i for i in f if graph.node(i).op is not Op.INPUT_IDS] for f in self.fetch_at]
        self._programs: dict[tuple, tuple | None] = {}

    def q8(self, K: int, fmt: str = "", group_size: int = 0) -> Q8:
        """The q8 quantizer of width K in the layout the kernels of weight format `fmt` read."""
        pairs = pair_layout(self.target, fmt, group_size)
        if (K, pairs) not in self._q8:
            self._q8[K, pairs] = Q8(self, K, pairs, self.planes)
        return self._q8[K, pairs]

    def weight(self, name: str | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(data, scales) arrays of a stored weight, zero-copy from the plan's mmap."""
        if name is None:
            return None, None
        a = self.w.resident_arrays(name) if self.hugepages else self.w.arrays(name)
        return (a["w"], None) if "w" in a else (a["qs"], a["scales"])

    def _rows(self, name: str) -> int:
        """Rows of weight `name` as stored (its first array's leading dimension)."""
        return next(iter(self.w.arrays(name).values())).shape[0]

    def _bind(self, n: Node):
        binder = BINDERS.get(n.op)
        if binder is None:
            raise BackendError(f"the llvm backend has no kernel for op {n.op.value} (%{n.id}); "
                               f"plans from `stratac compile` fuse it away — recompile, or use --backend reference")
        return binder(self, n)

    def run_segment(self, env: dict, input_ids: np.ndarray, cache: KVCache, seg: Segment = WHOLE) -> None:
        """Run this executor's nodes; operands from other devices come from (and results go to) env.
        seg: only nodes [lo, hi) (a segment run in two parts; results go to env after the last);
        its T_pad is the GPU's (this backend runs at the step's length)."""
        lo, hi = seg.lo, seg.hi
        B, T = input_ids.shape
        M = B * T
        if M not in self.frames:
            frame = Frame(self, M)
            self.frames[M] = (frame, [b(frame) for b in self.binders])
        frame, ops = self.frames[M]
        hi = len(ops) if hi is None else hi
        if lo == 0:
            for rows, name in self.tables:
                check_token_ids(input_ids, rows, name)
            frame.ids[:] = input_ids.reshape(-1)
        step = Step(B, T, cache, self.phase_ns)
        prog = None
        if trace.ACTIVE is None and self.phase_ns is None and getattr(self.w, "disk_tier", None) is None \
                and all(env.get(i) is IN_FRAME for f in self._fetch_vals[lo:hi] for i in f):
            prog = self.host_program(frame, ops, step, lo, hi)
        if prog is not None:             # the whole range as one native call
            for f in prog[1]:
                f(step)
            if len(prog[0]):
                self.pool.run_program(prog[0].ctypes.data, len(prog[0]))
        elif trace.ACTIVE is None:
            for op, fetch in zip(ops[lo:hi], self.fetch_at[lo:hi]):
                if fetch:
                    self._fetch(env, frame, fetch, M)
                op(step)
        else:
            for n, op, fetch in zip(self.nodes[lo:hi], ops[lo:hi], self.fetch_at[lo:hi]):
                if fetch:
                    self._fetch(env, frame, fetch, M)
                with trace.ACTIVE.span(n.op.value, "cpu", node=n.id, tokens=M):
                    op(step)
        if hi == len(ops):
            for o in self.outputs:
                env[o] = frame.out(self.g.node(o)).copy()

    def host_program(self, frame: Frame, ops: list, step: Step, lo: int, hi: int, traced: bool = False):
        """(instructions int64[n, 10], pre-step functions) of ops [lo, hi) for this step shape, or
        None where an op has no native form (made once per shape and range). `traced`: the same
        program with a TSC instruction before the first op and after each, into a third item
        (int64[hi - lo + 1]: op j ran from its j-th entry to its (j+1)-th), for native traces."""
        key = (frame.M, step.B, step.T, lo, hi, traced)
        if key not in self._programs:
            prog, pres = [], []
            rec = np.zeros(hi - lo + 1, np.int64) if traced else None
            if traced:
                prog.append(ins(TSC, dst=rec.ctypes.data))
            for j, op in enumerate(ops[lo:hi]):
                make = getattr(op, "native", None)
                if make is None:
                    prog = None
                    break
                prog += make(step)
                if traced:
                    prog.append(ins(TSC, dst=rec.ctypes.data + 8 * (j + 1)))
                if op.pre is not None:
                    pres.append(op.pre)
            self._programs[key] = None if prog is None else \
                (np.ascontiguousarray(np.array(prog, np.int64).reshape(-1, 10)), pres) + ((rec,) if traced else ())
        return self._programs[key]

    def _fetch(self, env: dict, frame, inputs: list[int], M: int) -> None:
        """Segment inputs into their frame buffers; a GPU result is waited for and copied (straight
        into the kernel's buffer by `fetch_into` when the runtime gave one)."""
        for i in inputs:
            node = self.g.node(i)
            if node.op is Op.INPUT_IDS:
                continue
            v = env[i]
            if v is IN_FRAME:
                continue
            dst = frame.out(node)
            if isinstance(v, np.ndarray):
                np.copyto(dst, v.reshape(M, -1))
                continue
            t0 = time.perf_counter() if trace.ACTIVE is not None else 0.0
            if self.fetch_into is None or not self.fetch_into(v, dst):
                np.copyto(dst, np.asarray(v).reshape(M, -1))
            if trace.ACTIVE is not None:
                trace.ACTIVE.transfer("d2h", dst.nbytes, time.perf_counter() - t0, name="wait + copy")

    def run(self, input_ids: np.ndarray, cache: KVCache, last_only: bool = False) -> dict[int, np.ndarray]:
        B, T = input_ids.shape
        env: dict = {}
        set_spin()      # the default wait of idle workers (a mixed plan earlier may have shortened it)
        self.run_segment(env, input_ids, cache)
        cache.advance(T)
        return {o: env[o].reshape(B, T, -1) for o in self.g.outputs}


class SourceCollector:
    """Stands in for a KernelLibrary to list a graph's kernels without compiling them."""

    def __init__(self) -> None:
        self.sources: dict[str, str] = {}

    def address(self, ir_text: str, name: str) -> int:
        self.sources[name] = ir_text
        return 0


class _ShapeOnlyWeights:
    """Weight arrays with the right dtypes and shapes and no memory behind them."""

    def __init__(self, graph: Graph) -> None:
        self.g = graph

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        from strata_compiler.formats import get_format

        spec = self.g.weight(name)
        shapes = get_format(spec.fmt).array_shapes(spec.shape, spec.group_size or 32)
        return {a: np.broadcast_to(np.zeros(1, dt), shp) for a, (dt, shp) in shapes.items()}


def kernel_sources(graph: Graph, target: Target, act: str | None = None) -> dict[str, str]:
    """Name -> LLVM IR of every kernel the graph's llvm nodes need, as the executor would build them."""
    collector = SourceCollector()
    mine = [n.id for n in graph.nodes if n.backend == "llvm"]
    if mine:
        LLVMExecutor(graph, _ShapeOnlyWeights(graph), target, act, lib=collector, nodes=mine)
    return dict(sorted(collector.sources.items()))


