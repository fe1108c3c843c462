"""The LLVM CPU executor: a kernel-level graph run as JIT-compiled kernels on the thread pool.

Binding (once per plan) generates and compiles every kernel the graph needs, so nothing is
compiled on the hot path; kernels read weights straight from the plan's mmapped arrays. A step
(prefill chunk or decode) takes activation buffers from plan-memory's slots, sized for its
M = B*T tokens, and launches kernels over the pool.

Activations for int8/int4 weights (groups of 32) are quantized to q8 blocks once per consumer,
so the matrix kernels run on integer dot products (STRATA_CPU_ACT=f32 keeps them f32: exact,
slower). Legend: B batch, T tokens per sequence, M = B*T, D hidden, E experts.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from strata_compiler.errors import BackendError, UsageError
from strata_compiler.ir import Graph, Node, Op
from strata_compiler.rope import rope_inv_freq
from strata_compiler.backends.xla import cuda_rt
from strata_compiler.runtime import trace
from strata_compiler.runtime import disk_tier
from strata_compiler.runtime.kv_cache import KVCache

from .codegen import attention as attn_gen
from .codegen import elementwise as ew
from .codegen.common import KernelSource, float_slot
from .codegen.dot import Q8_BLOCK, needs_q8, pair_layout
from .codegen.linear import LinearSpec, generate as linear_gen
from .codegen.moe import MoESpec, down as moe_down_gen, gate_up as moe_gate_up_gen, h_stride, pairs as moe_pairs_gen
from .jit import KernelLibrary, library
from .pool import get_pool, set_spin, split_from_env
from .target import Target

_NULL = 0

#: Benchmarks (benchmarks/cpu_share.py) set this to a dict to collect the MoE op's phases:
#: phase name -> list of nanoseconds, one per call. None (the default) costs one test per call.
PHASE_NS: dict[str, list[int]] | None = None


def _no_clock() -> int:
    return 0


_PHASES = ("moe.mask", "moe.pairs", "moe.quant_x", "moe.gate_up", "moe.quant_h", "moe.down")


def _record_phases(t: list[int], active: np.ndarray, gate_up: tuple, down: tuple) -> None:
    """A MoE call's phase times (t: the clock before, between and after its steps) and the weight
    bytes of its active experts, into PHASE_NS."""
    for k, a, b in zip(_PHASES, t, t[1:]):
        PHASE_NS.setdefault(k, []).append(b - a)
    for key, (w, s) in (("moe.gate_up_bytes", gate_up), ("moe.down_bytes", down)):
        PHASE_NS.setdefault(key, []).append(int(sum(w[e].nbytes + (s[e].nbytes if s is not None else 0)
                                                    for e in active)))


# Segment programs (pool.py `strata_run_program`): a CPU partition's ops as one native call. Each
# op's step function may carry `native(step) -> [instruction]` (built once per step shape) and
# `pre(step)` (Python run before the program every step: per-step argument values); run_segment
# runs the program where every op of the range has one. Instructions are 10 int64s.
_PAR, _ONE, _SET, _COPY, _GATHER, _TSC, _MASK = range(7)


def _ins(kind: int, fn: int = 0, args: int = 0, f3: int = 0, src: int = 0, f5: int = 0, f6: int = 0,
         dst: int = 0, f8: int = 0, f9: int = 0) -> tuple:
    return (kind, fn, args, f3, src, f5, f6, dst, f8, f9)


def _op(run: Callable, native: Callable | None, pre: Callable | None = None) -> Callable:
    """Step function `run`, marked with its native form (see above)."""
    run.native, run.pre = native, pre
    return run


def native_wanted() -> bool:
    """STRATA_NATIVE_SEGMENTS (default 1): run a CPU partition's ops as one native program where
    they allow it, instead of a Python call per op (tracing and the MoE phase timer keep the latter)."""
    from strata_compiler.env import switch

    return switch("STRATA_NATIVE_SEGMENTS", True)


class Kernel:
    """A compiled kernel and the positions of its argument slots."""

    def __init__(self, lib: "KernelLibrary | SourceCollector", src: KernelSource) -> None:
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
        return _ins(_PAR, self.kernel.addr, self.addr, total, src, mult, min_chunk)

    def slot(self, name: str) -> int:
        """Address of argument slot `name` (a program's SET writes there)."""
        return self.addr + 8 * self.kernel.index[name]

    def go_op(self, pool, total: int, min_chunk: int = 1) -> Callable:
        """A step function that runs go(total), with its native form."""
        return _op(lambda step: self.go(pool, total, min_chunk=min_chunk), lambda step: [self.par(total, min_chunk)])


def _ld(a: np.ndarray) -> int:
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

    def __init__(self, exe: "LLVMExecutor", M: int) -> None:
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
    """What one forward step needs: token counts and the cache."""

    B: int
    T: int
    cache: KVCache

    @property
    def M(self) -> int:
        return self.B * self.T


Op_ = Callable[[Step], None]
Binder = Callable[["LLVMExecutor", Node], Callable[[Frame], Op_]]


class Q8:
    """Quantizes f32 rows of width K to q8 blocks (int8 data, f32 scales, i32 block sums)."""

    def __init__(self, exe: "LLVMExecutor", K: int, pairs: bool = False) -> None:
        self.K, self.pairs = K, pairs
        self.ng = -(-K // Q8_BLOCK)
        self.kernel = Kernel(exe.lib, ew.quantize_q8(K, exe.target, pairs))

    def prepare(self, frame: Frame, x: np.ndarray, key: str):
        """Scratch (xq, xd, xs) for x's rows and a function that fills them."""
        M = x.shape[0]
        key += ".p" if self.pairs else ""     # the two layouts of one input are separate scratch
        xq = frame.temp(key + ".q", (M, self.ng * Q8_BLOCK), np.int8)
        xd = frame.temp(key + ".d", (M, self.ng), np.float32)
        xs = frame.temp(key + ".s", (M, self.ng), np.int32)
        a = self.kernel.args(x=x, xq=xq, xd=xd, xs=xs, ldx=_ld(x))
        pool = frame.exe.pool

        def run(rows: int = M) -> None:
            a.go(pool, rows, min_chunk=4)
        run.args = a            # for programs: a.par(rows, 4)
        return (xq, xd, xs), run


def hugepages_wanted() -> bool:
    """STRATA_HUGEPAGES=1 / 0, else whether transparent huge pages are available for madvise'd
    memory (2-core VM, the 2-layer benchmark shape all on the CPU: decode 107 -> 123 tok/s)."""
    raw = os.environ.get("STRATA_HUGEPAGES", "")
    if raw in ("0", "1"):
        return raw == "1"
    if raw:
        raise UsageError(f"STRATA_HUGEPAGES={raw!r}: use 1 (copy CPU weights into huge pages) or 0 (map the file)")
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


class LLVMExecutor:
    def __init__(self, graph: Graph, weights, target: Target | None = None, act: str | None = None,
                 lib: "KernelLibrary | SourceCollector | None" = None, nodes: list[int] | None = None) -> None:
        self.g = graph
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
        self.pool = get_pool()
        self.pool.split = split_from_env()     # STRATA_POOL_SPLIT, read per executor (benchmarks' A/Bs)
        self.act = (act or os.environ.get("STRATA_CPU_ACT") or "q8").lower()
        if self.act not in ("q8", "f32"):
            raise BackendError(f"STRATA_CPU_ACT={self.act!r}: use q8 or f32")
        self._q8: dict[tuple[int, bool], Q8] = {}
        # the kernels' weights copied into memory backed by 2 MiB pages (runtime/plan.py
        # resident_arrays): on where the OS offers transparent huge pages, STRATA_HUGEPAGES=0|1
        # decides otherwise; weights without that method (tests' stand-ins) stay as they are
        self.hugepages = hugepages_wanted() and hasattr(weights, "resident_arrays")
        self.binders = [self._bind(n) for n in self.nodes]   # every kernel compiled here, not per step
        self.frames: dict[int, tuple[Frame, list[Op_]]] = {}
        self.native = native_wanted()   # segment programs (STRATA_NATIVE_SEGMENTS)
        # per op, the inputs fetched before it that are values (not the token ids): a program runs
        # only where all of them are already in the frame (a fused step's host call put them there)
        self._fetch_vals = [[i for i in f if graph.node(i).op is not Op.INPUT_IDS] for f in self.fetch_at]
        self._programs: dict[tuple, tuple | None] = {}

    def q8(self, K: int, fmt: str = "", group_size: int = 0) -> Q8:
        """The q8 quantizer of width K in the layout the kernels of weight format `fmt` read."""
        pairs = pair_layout(self.target, fmt, group_size)
        if (K, pairs) not in self._q8:
            self._q8[K, pairs] = Q8(self, K, pairs)
        return self._q8[K, pairs]

    def weight(self, name: str | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(data, scales) arrays of a stored weight, zero-copy from the plan's mmap."""
        if name is None:
            return None, None
        a = self.w.resident_arrays(name) if self.hugepages else self.w.arrays(name)
        return (a["w"], None) if "w" in a else (a["qs"], a["scales"])

    def _bind(self, n: Node):
        binder = _BINDERS.get(n.op)
        if binder is None:
            raise BackendError(f"the llvm backend has no kernel for op {n.op.value} (%{n.id}); "
                               f"plans from `stratac compile` fuse it away — recompile, or use --backend reference")
        return binder(self, n)

    def run_segment(self, env: dict, input_ids: np.ndarray, cache: KVCache, lo: int = 0, hi: int | None = None) -> None:
        """Run this executor's nodes; operands from other devices come from (and results go to) env.
        lo/hi: only nodes [lo, hi) (a segment run in two parts; results go to env after the last)."""
        B, T = input_ids.shape
        M = B * T
        if M not in self.frames:
            frame = Frame(self, M)
            self.frames[M] = (frame, [b(frame) for b in self.binders])
        frame, ops = self.frames[M]
        hi = len(ops) if hi is None else hi
        if lo == 0:
            frame.ids[:] = input_ids.reshape(-1)
        step = Step(B, T, cache)
        prog = None
        if trace.ACTIVE is None and self.native and PHASE_NS is None and id(self.g) not in disk_tier.TIERS \
                and all(env.get(i) is IN_FRAME for f in self._fetch_vals[lo:hi] for i in f):
            prog = self._program(frame, ops, step, lo, hi)
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

    def _program(self, frame: Frame, ops: list, step: Step, lo: int, hi: int, traced: bool = False):
        """(instructions int64[n, 10], pre-step functions) of ops [lo, hi) for this step shape, or
        None where an op has no native form (made once per shape and range). `traced`: the same
        program with a TSC instruction before the first op and after each, into a third item
        (int64[hi - lo + 1]: op j ran from its j-th entry to its (j+1)-th), for native traces."""
        key = (frame.M, step.B, step.T, lo, hi, traced)
        if key not in self._programs:
            prog, pres = [], []
            rec = np.zeros(hi - lo + 1, np.int64) if traced else None
            if traced:
                prog.append(_ins(_TSC, dst=rec.ctypes.data))
            for j, op in enumerate(ops[lo:hi]):
                make = getattr(op, "native", None)
                if make is None:
                    prog = None
                    break
                prog += make(step)
                if traced:
                    prog.append(_ins(_TSC, dst=rec.ctypes.data + 8 * (j + 1)))
                if op.pre is not None:
                    pres.append(op.pre)
            self._programs[key] = None if prog is None else \
                (np.ascontiguousarray(np.array(prog, np.int64).reshape(-1, 10)), pres) + ((rec,) if traced else ())
        return self._programs[key]

    def _fetch(self, env: dict, frame, inputs: list[int], M: int) -> None:
        """Segment inputs into their frame buffers; a GPU result is waited for and copied (straight
        into the kernel's buffer when raw copies are on: backends/xla/cuda_rt.py)."""
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
            if not cuda_rt.fetch_into(v, dst):
                np.copyto(dst, np.asarray(v).reshape(M, -1))
            if trace.ACTIVE is not None:
                trace.ACTIVE.transfer("d2h", dst.nbytes, time.perf_counter() - t0, name="wait + copy")

    def run(self, input_ids: np.ndarray, cache: KVCache) -> dict[int, np.ndarray]:
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


# -- binders: Node -> (Frame -> step function) -------------------------------------------------------


def _src(frame: Frame, n: Node, i: int = 0) -> np.ndarray:
    """Operand i of n: the f32[M, C] result of the node that defines it."""
    return frame.out(frame.exe.g.node(n.args[i]))


def _bind_input(exe: LLVMExecutor, n: Node):
    return lambda frame: _op(lambda step: None, lambda step: [])


def _bind_embed(exe: LLVMExecutor, n: Node):
    spec = exe.g.weight(n.weight("table"))
    if spec.fmt != "f32":   # a quantized table: gather the stored rows, decode them with formats.py
        from strata_compiler.formats import get_format
        f, arrays = get_format(spec.fmt), exe.w.arrays(spec.name)

        def prepare_q(frame: Frame):
            out = frame.out(n)
            return lambda step: out.__setitem__(slice(None), f.dequantize(
                {k: v[frame.ids] for k, v in arrays.items()}, spec.shape[-1], spec.group_size or 32))
        return prepare_q
    table, _ = exe.weight(n.weight("table"))
    D = table.shape[1]
    k = Kernel(exe.lib, ew.embed(D, exe.target))

    def prepare(frame: Frame):
        a = k.args(ids=frame.ids, table=table, y=frame.out(n), ldy=D)
        return a.go_op(exe.pool, frame.M, 16)
    return prepare


def _norm_args(exe: LLVMExecutor, C: int, group: int, weight: str, eps: float):
    w, _ = exe.weight(weight)
    k = Kernel(exe.lib, ew.rms_norm(C, group, exe.target))
    return lambda x, y: k.args(x=x, w=w, y=y, ldx=_ld(x), ldy=_ld(y), eps=float_slot(eps))


def _bind_rms_norm(exe: LLVMExecutor, n: Node):
    C = n.type.shape[-1]
    mk = _norm_args(exe, C, n.attr("group", 0), n.weight("w"), n.attr("eps"))

    def prepare(frame: Frame):
        a = mk(_src(frame, n), frame.out(n))
        return a.go_op(exe.pool, frame.M, 4)
    return prepare


def _bind_linear(exe: LLVMExecutor, n: Node):
    spec_w = exe.g.weight(n.weight("w"))
    fmt, G = spec_w.fmt, spec_w.group_size
    K = spec_w.shape[1]
    N = n.type.shape[-1]
    q8 = exe.act == "q8" and needs_q8(fmt, G)
    spec = LinearSpec(fmt, N, K, G, q8, bias=n.weight("b") is not None,
                      silu_mul=n.attr("epilogue", "none") == "silu_mul", residual=len(n.args) == 2)
    k = Kernel(exe.lib, linear_gen(spec, exe.target))
    w, s = exe.weight(n.weight("w"))
    b, _ = exe.weight(n.weight("b"))
    norm = (_norm_args(exe, K, 0, n.weight("norm"), n.attr("eps"))
            if n.attr("prologue", "none") == "rms_norm" else None)
    quant = exe.q8(K, fmt, G) if q8 else None
    kp = -(-K // G) * G if G else K

    def prepare(frame: Frame):
        M = frame.M
        pool = exe.pool
        x = _src(frame, n)
        before: list[Callable[[], None]] = []    # what must run ahead of the matrix kernel
        prog: list | None = []                   # ... as program instructions (None: not expressible)
        if norm is not None:
            xn = frame.temp("norm", (M, kp))    # columns past K stay zero (whole groups)
            na = norm(x, xn[:, :K] if kp != K else xn)
            before.append(lambda: na.go(pool, M, min_chunk=4))
            prog.append(na.par(M, 4))
            x = xn
        elif kp != K and not q8:
            xp, src = frame.temp("pad", (M, kp)), x
            before.append(lambda: np.copyto(xp[:, :K], src))
            prog = None
            x = xp
        xd = xs = None
        if quant is not None:
            (x, xd, xs), qrun = quant.prepare(frame, x[:, :K] if x.shape[1] != K else x, "x")
            before.append(qrun)
            if prog is not None:
                prog.append(qrun.args.par(M, 4))
        r = _src(frame, n, 1) if len(n.args) == 2 else None
        a = k.args(y=frame.out(n), x=x, xd=xd, xs=xs, w=w, s=s, b=b, r=r, xidx=None, M=M,
                   ldx=_ld(x), ldy=N, ldr=N)

        def run(step: Step) -> None:
            for f in before:
                f()
            a.go(pool, N, min_chunk=16)
        return _op(run, None if prog is None else lambda step: prog + [a.par(N, 16)])
    return prepare


def _bind_attention(exe: LLVMExecutor, n: Node):
    H, KV, hd = n.attr("n_heads"), n.attr("n_kv_heads"), n.attr("head_dim")
    prep = Kernel(exe.lib, attn_gen.attn_prep(H, KV, hd, n.attr("qk_norm"), n.has_attr("clip_qkv"), exe.target))
    core = Kernel(exe.lib, attn_gen.attn_core(H, KV, hd, exe.target))
    inv = np.ascontiguousarray(rope_inv_freq(hd, dict(n.attrs)), np.float32)
    qn, _ = exe.weight(n.weight("q_norm"))
    kn, _ = exe.weight(n.weight("k_norm"))
    layer = n.attr("layer")

    def prepare(frame: Frame):
        qkv = _src(frame, n)
        q = frame.temp("attn.q", (frame.M, H * hd))
        o = frame.out(n)
        ap = prep.args(qkv=qkv, qnw=qn, knw=kn, qout=q, ldq=_ld(qkv), inv_freq=inv,
                       eps=float_slot(n.attr("eps", 1e-6)), clip=float_slot(n.attr("clip_qkv", 0.0)))
        ac = core.args(qout=q, o=o, ldo=H * hd)
        pool = exe.pool

        def pre(step: Step) -> None:
            c = step.cache
            if c.length + step.T > c.capacity:
                raise UsageError(f"sequence of {c.length + step.T} tokens exceeds the KV cache capacity {c.capacity}")
            kc, vc = c.k[layer], c.v[layer]
            ap.set(kc=kc, vc=vc, T=step.T, past=c.length, cap=c.capacity)
            ac.set(kc=kc, vc=vc, T=step.T, past=c.length, cap=c.capacity)

        def run(step: Step) -> None:
            pre(step)
            ap.go(pool, frame.M, min_chunk=2)
            ac.go(pool, step.B * H)
        return _op(run, lambda step: [ap.par(frame.M, 2), ac.par(step.B * H)], pre)
    return prepare


def _bind_moe(exe: LLVMExecutor, n: Node):
    if n.weight("gate_up") is None:
        raise BackendError(f"moe_ffn %{n.id} has separate gate and up weights; the llvm backend needs the fused "
                           f"gate_up of the fuse pass — recompile the plan")
    gu_spec = exe.g.weight(n.weight("gate_up"))
    fmt, G = gu_spec.fmt, gu_spec.group_size
    E, I2, D = gu_spec.shape
    I = I2 // 2
    q8 = exe.act == "q8" and needs_q8(fmt, G)
    dn_spec = exe.g.weight(n.weight("down"))
    dG = dn_spec.group_size
    spec = MoESpec(fmt, D, I, G, q8, residual=len(n.args) == 3, down_fmt=dn_spec.fmt,
                   down_q8=exe.act == "q8" and needs_q8(dn_spec.fmt, dG), down_group_size=dG)
    ku = Kernel(exe.lib, moe_gate_up_gen(spec, exe.target))
    kd = Kernel(exe.lib, moe_down_gen(spec, exe.target))
    kp = Kernel(exe.lib, moe_pairs_gen(E, exe.target))
    wu, su = exe.weight(n.weight("gate_up"))
    wd, sd = exe.weight(n.weight("down"))
    qx = exe.q8(D, fmt, G) if q8 else None
    qh = exe.q8(I, dn_spec.fmt, dG) if spec.dq8 else None
    dp = -(-D // G) * G if (G and not q8) else D     # f32 rows padded to whole groups
    ip = h_stride(spec)
    ids = tuple(n.attr("experts", ()))
    idx = np.array(ids, np.int64)
    from strata_compiler.passes.expert_split import static_nonresident
    from strata_compiler.runtime import disk_tier, expert_cache

    cache_key = n.attr("cache", "") if not ids else ""    # an expert cache's host side
    plan_mask = static_nonresident(exe.g, n) if cache_key else None
    weight_names = [w for _, w in n.weights]

    def prepare(frame: Frame):
        M = frame.M
        x, comb = _src(frame, n, 0), _src(frame, n, 1)
        gather = None
        if cache_key:   # every expert but those resident in the GPU cache (the live cache's, else the plan's)
            full, comb = comb, frame.temp(f"moe.comb{n.id}", (M, E))

            def masked():
                live = expert_cache.lookup(exe.g, cache_key)
                np.multiply(full, (plan_mask if live is None else live.nonresident)[None, :], out=comb)
                if live is not None:
                    live.observe(full)
            gather = masked
        elif ids:   # this node computes a share of the layer's experts: their routing columns
            if ids == tuple(range(ids[0], ids[0] + E)):
                comb = comb[:, ids[0]:ids[0] + E]          # a strided view: the kernel takes ldc
            else:
                full, comb = comb, frame.temp(f"moe.comb{n.id}", (M, E))
                gather = lambda: np.take(full, idx, axis=1, out=comb)  # noqa: E731
        Pmax = M * E
        tok = frame.temp("moe.tok", (Pmax,), np.int64)
        exp = frame.temp("moe.exp", (Pmax,), np.int64)
        pw = frame.temp("moe.w", (Pmax,), np.float32)
        first = frame.temp("moe.first", (E + 1,), np.int64)
        active = frame.temp("moe.active", (E,), np.int64)
        count = frame.temp("moe.count", (2,), np.int64)
        h = frame.temp("moe.h", (Pmax, ip))
        xin = x
        if dp != D:
            xin = frame.temp("moe.xpad", (M, dp))
        xd = xs = hd = hs = None
        qxrun = qhrun = None
        hin = h
        if qx is not None:
            (xin, xd, xs), qxrun = qx.prepare(frame, x, "moe.x")
        if qh is not None:
            (hin, hd, hs), qhrun = qh.prepare(frame, h[:, :I] if ip != I else h, "moe.h")
        r = _src(frame, n, 2) if len(n.args) == 3 else None
        au = ku.args(h=h, x=xin, xd=xd, xs=xs, w=wu, s=su, pair_tok=tok, first=first, active=active,
                     ldx=_ld(xin))
        ad = kd.args(y=frame.out(n), r=r, h=hin, hd=hd, hs=hs, w=wd, s=sd, pair_tok=tok, pair_exp=exp, pair_w=pw,
                     M=M, ldy=D, ldr=D)
        ap = kp.args(comb=comb, ldc=_ld(comb), M=M, tok=tok, exp=exp, pw=pw, first=first, active=active, count=count)
        pool = exe.pool
        # the program: count = [P pairs, nA active experts] written by the pairs kernel sizes the rest
        prog: list | None = None
        if not (xin is not x and qxrun is None):
            prog = []
            if gather is not None and not cache_key:      # the share's routing columns (32-bit values)
                prog.append(_ins(_GATHER, f3=M, src=full.ctypes.data, f5=_ld(full), f6=_ld(comb),
                                 dst=comb.ctypes.data, f8=idx.ctypes.data, f9=E))
            prog.append(_ins(_ONE, kp.addr, ap.addr, 0, f8=1))
            if qxrun is not None:
                prog.append(qxrun.args.par(M, 4))
            prog.append(au.par(0, 8, src=count.ctypes.data + 8, mult=I))
            if qhrun is not None:
                prog.append(qhrun.args.par(0, 4, src=count.ctypes.data, mult=1))
            prog.append(_ins(_SET, src=count.ctypes.data, f5=1, dst=ad.slot("P")))
            prog.append(ad.par(D, 16))
        native = None if prog is None else lambda step: prog
        if prog is not None and cache_key:
            keep: list = []     # the counts of a plan without a live cache, alive as long as its program

            def native(step):
                """The routing weights of the experts the GPU does not hold (the live cache's mask,
                read as the program runs: its swaps and prefetch change it in place), counted per
                expert into the cache's counts (ExpertCache.fold turns them into hits, misses and
                what the swaps learn from); looked up when the program is built, after the
                session registered its caches."""
                live = expert_cache.lookup(exe.g, cache_key)
                mask = plan_mask if live is None else live.nonresident
                counts = np.zeros(E, np.int64) if live is None else live.counts
                keep.append((mask, counts))
                return [_ins(_MASK, fn=counts.ctypes.data, f3=M, src=full.ctypes.data, f5=_ld(full), f6=_ld(comb),
                             dst=comb.ctypes.data, f8=mask.ctypes.data, f9=E)] + prog

        def run(step: Step) -> None:
            clock = _no_clock if PHASE_NS is None else time.perf_counter_ns
            t = [clock()]
            if gather is not None:
                gather()
            t.append(clock())
            pool.run(kp.addr, ap.addr, 0, 1)                    # routing pairs, grouped by expert
            P, nA = int(count[0]), int(count[1])
            t.append(clock())
            if xin is not x and qxrun is None:
                xin[:, :D] = x
            if qxrun is not None:
                qxrun()
            t.append(clock())
            au.go(pool, nA * I, min_chunk=8)
            t.append(clock())
            if qhrun is not None:
                qhrun(P)
            t.append(clock())
            ad.set(P=P).go(pool, D, min_chunk=16)
            t.append(clock())
            if disk_tier.TIERS:                  # experts on the disk tier: their pages go now
                disk_tier.after(exe.g, weight_names)
            if PHASE_NS is not None:
                _record_phases(t, active[:nA], (wu, su), (wd, sd))
        return _op(run, native)
    return prepare


def _bind_route(exe: LLVMExecutor, n: Node):
    E = n.type.shape[-1]
    k = Kernel(exe.lib, ew.route(E, n.attr("k"), bool(n.attr("norm")), exe.target))

    def prepare(frame: Frame):
        x = _src(frame, n)
        a = k.args(x=x, y=frame.out(n), ldx=_ld(x), ldy=E)
        return a.go_op(exe.pool, frame.M, 16)
    return prepare


def _bind_binary(op: str):
    def bind(exe: LLVMExecutor, n: Node):
        C = n.type.shape[-1]
        a_cols, b_cols = (exe.g.node(a).type.shape[-1] for a in n.args)
        swap = a_cols != C                               # the kernel broadcasts its second operand
        k = Kernel(exe.lib, ew.binary(op, C, a_cols if swap else b_cols, exe.target))

        def prepare(frame: Frame):
            a, b = _src(frame, n, 0), _src(frame, n, 1)
            if swap:
                a, b = b, a
            args = k.args(a=a, b=b, y=frame.out(n), lda=_ld(a), ldb=_ld(b), ldy=C)
            return args.go_op(exe.pool, frame.M, 16)
        return prepare
    return bind


def _bind_unary(op: str):
    def bind(exe: LLVMExecutor, n: Node):
        C = n.type.shape[-1]
        k = Kernel(exe.lib, ew.unary(op, C, exe.target))

        def prepare(frame: Frame):
            x = _src(frame, n)
            a = k.args(x=x, y=frame.out(n), ldx=_ld(x), ldy=C, limit=float_slot(n.attr("limit", 0.0)))
            return a.go_op(exe.pool, frame.M, 16)
        return prepare
    return bind


def _bind_transfer(exe: LLVMExecutor, n: Node):
    """An activation arriving from another device: its operand was copied into place already."""
    def prepare(frame: Frame):
        dst, src = frame.out(n), _src(frame, n)
        same = dst.flags.c_contiguous and src.flags.c_contiguous and dst.dtype == src.dtype and dst.shape == src.shape
        return _op(lambda step: np.copyto(dst, src),
                   (lambda step: [_ins(_COPY, f3=dst.nbytes, src=src.ctypes.data, dst=dst.ctypes.data)]) if same else None)
    return prepare


def _bind_slice(exe: LLVMExecutor, n: Node):
    start, stop = n.attr("start"), n.attr("stop")
    k = Kernel(exe.lib, ew.slice_copy(start, stop, exe.target))

    def prepare(frame: Frame):
        x = _src(frame, n)
        a = k.args(x=x, y=frame.out(n), ldx=_ld(x), ldy=stop - start)
        return a.go_op(exe.pool, frame.M, 16)
    return prepare


_BINDERS: dict[Op, Binder] = {
    Op.INPUT_IDS: _bind_input,
    Op.EMBED: _bind_embed,
    Op.RMS_NORM: _bind_rms_norm,
    Op.LINEAR: _bind_linear,
    Op.FUSED_ATTENTION: _bind_attention,
    Op.MOE_FFN: _bind_moe,
    Op.ROUTE: _bind_route,
    Op.ADD: _bind_binary("add"),
    Op.MUL: _bind_binary("mul"),
    Op.SIGMOID: _bind_unary("sigmoid"),
    Op.SILU: _bind_unary("silu"),
    Op.CLAMP: _bind_unary("clamp"),
    Op.SLICE: _bind_slice,
    Op.TRANSFER: _bind_transfer,
}
