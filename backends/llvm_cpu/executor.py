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
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from strata_compiler.errors import BackendError, UsageError
from strata_compiler.ir import Graph, Node, Op
from strata_compiler.rope import rope_inv_freq
from strata_compiler.runtime.kv_cache import KVCache

from .codegen import attention as attn_gen
from .codegen import elementwise as ew
from .codegen.common import KernelSource, float_slot
from .codegen.dot import Q8_BLOCK, needs_q8
from .codegen.linear import LinearSpec, generate as linear_gen
from .codegen.moe import MoESpec, down as moe_down_gen, gate_up as moe_gate_up_gen
from .jit import KernelLibrary, library
from .pool import get_pool
from .target import Target

_NULL = 0


class Kernel:
    """A compiled kernel and its argument slots."""

    def __init__(self, lib: KernelLibrary, src: KernelSource) -> None:
        self.src = src
        self.addr = lib.address(src.ir, src.name)
        self.index = {p: i for i, p in enumerate(src.params)}

    def launch(self, pool, vals: dict, total: int, min_chunk: int = 1) -> None:
        args = (ctypes.c_int64 * len(self.src.params))(*[int(vals.get(p, 0)) for p in self.src.params])
        pool.parallel_for(self.addr, ctypes.addressof(args), total, min_chunk=min_chunk)


def _ptr(a: np.ndarray | None) -> int:
    return 0 if a is None else a.ctypes.data


@dataclass
class Step:
    """What one forward step needs: token counts, the cache and the live activations."""

    ids: np.ndarray            # i64[M]
    B: int
    T: int
    cache: KVCache
    env: dict = field(default_factory=dict)   # node id -> f32[M, C] (or i64[M] for input_ids)

    @property
    def M(self) -> int:
        return self.B * self.T


class Q8:
    """Scratch for one activation matrix quantized to q8 blocks (int8 data, f32 scales, i32 sums)."""

    def __init__(self, exe: "LLVMExecutor", K: int) -> None:
        self.K = K
        self.ng = -(-K // Q8_BLOCK)
        self.kernel = Kernel(exe.lib, ew.quantize_q8(K, exe.target))
        self.exe = exe

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        M = x.shape[0]
        xq = np.empty((M, self.ng * Q8_BLOCK), np.int8)
        xd = np.empty((M, self.ng), np.float32)
        xs = np.empty((M, self.ng), np.int32)
        self.kernel.launch(self.exe.pool, dict(x=_ptr(x), xq=_ptr(xq), xd=_ptr(xd), xs=_ptr(xs), ldx=x.shape[1]), M)
        return xq, xd, xs


class LLVMExecutor:
    def __init__(self, graph: Graph, weights, target: Target | None = None, act: str | None = None,
                 lib: "KernelLibrary | SourceCollector | None" = None) -> None:
        self.g = graph
        self.w = weights
        self.target = target or Target.host()
        self.lib = lib or library(self.target)
        self.pool = get_pool()
        self.act = (act or os.environ.get("STRATA_CPU_ACT") or "q8").lower()
        if self.act not in ("q8", "f32"):
            raise BackendError(f"STRATA_CPU_ACT={self.act!r}: use q8 or f32")
        self._q8: dict[int, Q8] = {}
        last_use: dict[int, int] = {}
        for i, n in enumerate(graph.nodes):
            for a in n.args:
                last_use[a] = i
        outs = set(graph.outputs)
        self.frees = [[a for a in n.args if last_use[a] == i and a not in outs] for i, n in enumerate(graph.nodes)]
        self.steps: list[Callable[[Step], None]] = [self._bind(n) for n in graph.nodes]

    # -- binding ----------------------------------------------------------------------------

    def q8(self, K: int) -> Q8:
        if K not in self._q8:
            self._q8[K] = Q8(self, K)
        return self._q8[K]

    def _weight(self, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        a = self.w.arrays(name)
        return (a["w"], None) if "w" in a else (a["qs"], a["scales"])

    def _bind(self, n: Node) -> Callable[[Step], None]:
        binder = _BINDERS.get(n.op)
        if binder is None:
            raise BackendError(f"the llvm backend has no kernel for op {n.op.value} (%{n.id}); "
                               f"plans from `stratac compile` fuse it away — recompile, or use --backend reference")
        return binder(self, n)

    def run(self, input_ids: np.ndarray, cache: KVCache) -> dict[int, np.ndarray]:
        B, T = input_ids.shape
        step = Step(np.ascontiguousarray(input_ids.reshape(-1), dtype=np.int64), B, T, cache)
        outputs = set(self.g.outputs)
        for i, fn in enumerate(self.steps):
            fn(step)
            for a in self.frees[i]:
                if a not in outputs:
                    del step.env[a]
        cache.advance(T)
        return {o: step.env[o].reshape(B, T, -1) for o in self.g.outputs}


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
    if any(n.backend == "llvm" for n in graph.nodes):
        LLVMExecutor(graph, _ShapeOnlyWeights(graph), target, act, lib=collector)
    return dict(sorted(collector.sources.items()))


# -- binders: Node -> step function ---------------------------------------------------------------

def _out(step: Step, n: Node, cols: int) -> np.ndarray:
    y = np.empty((step.M, cols), np.float32)
    step.env[n.id] = y
    return y


def _bind_input(exe: LLVMExecutor, n: Node):
    def run(step: Step) -> None:
        step.env[n.id] = step.ids
    return run


def _bind_embed(exe: LLVMExecutor, n: Node):
    table, _ = exe._weight(n.weight("table"))
    D = table.shape[1]
    k = Kernel(exe.lib, ew.embed(D, exe.target))

    def run(step: Step) -> None:
        y = _out(step, n, D)
        k.launch(exe.pool, dict(ids=_ptr(step.ids), table=_ptr(table), y=_ptr(y), ldy=D), step.M, min_chunk=16)
    return run


def _rms_norm_kernel(exe: LLVMExecutor, C: int, group: int, weight: str, eps: float):
    w, _ = exe._weight(weight)
    k = Kernel(exe.lib, ew.rms_norm(C, group, exe.target))

    def apply(x: np.ndarray, y: np.ndarray) -> None:
        k.launch(exe.pool, dict(x=_ptr(x), w=_ptr(w), y=_ptr(y), ldx=x.shape[1], ldy=y.shape[1],
                                eps=float_slot(eps)), x.shape[0], min_chunk=4)
    return apply


def _bind_rms_norm(exe: LLVMExecutor, n: Node):
    C = n.type.shape[-1]
    apply = _rms_norm_kernel(exe, C, n.attr("group", 0), n.weight("w"), n.attr("eps"))

    def run(step: Step) -> None:
        x = step.env[n.args[0]]
        apply(x, _out(step, n, C))
    return run


def _bind_linear(exe: LLVMExecutor, n: Node):
    spec_w = exe.g.weight(n.weight("w"))
    fmt, G = spec_w.fmt, spec_w.group_size
    K = spec_w.shape[1]
    silu = n.attr("epilogue", "none") == "silu_mul"
    N = n.type.shape[-1]
    q8 = exe.act == "q8" and needs_q8(fmt, G)
    spec = LinearSpec(fmt, N, K, G, q8, bias=n.weight("b") is not None, silu_mul=silu, residual=len(n.args) == 2)
    k = Kernel(exe.lib, linear_gen(spec, exe.target))
    w, s = exe._weight(n.weight("w"))
    b = exe._weight(n.weight("b"))[0] if n.weight("b") else None
    norm = _rms_norm_kernel(exe, K, 0, n.weight("norm"), n.attr("eps")) if n.attr("prologue", "none") == "rms_norm" else None
    quant = exe.q8(K) if q8 else None
    pad = (-(-K // G) * G) if (G and not q8 and K % G) else 0

    def run(step: Step) -> None:
        x = step.env[n.args[0]]
        if norm is not None:
            xn = np.empty((x.shape[0], K), np.float32)
            norm(x, xn)
            x = xn
        xd = xs = None
        if quant is not None:
            x, xd, xs = quant(x)
        elif pad:
            xp = np.zeros((x.shape[0], pad), np.float32)
            xp[:, :K] = x
            x = xp
        y = _out(step, n, N)
        r = step.env[n.args[1]] if len(n.args) == 2 else None
        k.launch(exe.pool, dict(y=_ptr(y), x=_ptr(x), xd=_ptr(xd), xs=_ptr(xs), w=_ptr(w), s=_ptr(s), b=_ptr(b),
                                r=_ptr(r), xidx=_NULL, M=step.M, ldx=x.shape[1] if not q8 else 0, ldy=N,
                                ldr=N), N, min_chunk=16)
    return run


def _bind_attention(exe: LLVMExecutor, n: Node):
    H, KV, hd = n.attr("n_heads"), n.attr("n_kv_heads"), n.attr("head_dim")
    mode = n.attr("qk_norm")
    clip = n.has_attr("clip_qkv")
    prep = Kernel(exe.lib, attn_gen.attn_prep(H, KV, hd, mode, clip, exe.target))
    core = Kernel(exe.lib, attn_gen.attn_core(H, KV, hd, exe.target))
    inv = np.ascontiguousarray(rope_inv_freq(hd, dict(n.attrs)), np.float32)
    qn = exe._weight(n.weight("q_norm"))[0] if n.weight("q_norm") else None
    kn = exe._weight(n.weight("k_norm"))[0] if n.weight("k_norm") else None
    layer = n.attr("layer")
    eps = float_slot(n.attr("eps", 1e-6))
    lim = float_slot(n.attr("clip_qkv", 0.0))

    def run(step: Step) -> None:
        qkv = step.env[n.args[0]]
        c = step.cache
        if c.length + step.T > c.capacity:
            raise UsageError(f"sequence of {c.length + step.T} tokens exceeds the KV cache capacity {c.capacity}")
        q = np.empty((step.M, H * hd), np.float32)
        kc, vc = c.k[layer], c.v[layer]
        prep.launch(exe.pool, dict(qkv=_ptr(qkv), qnw=_ptr(qn), knw=_ptr(kn), qout=_ptr(q), kc=_ptr(kc), vc=_ptr(vc),
                                   inv_freq=_ptr(inv), T=step.T, past=c.length, cap=c.capacity, ldq=qkv.shape[1],
                                   eps=eps, clip=lim), step.M, min_chunk=2)
        o = _out(step, n, H * hd)
        core.launch(exe.pool, dict(qout=_ptr(q), kc=_ptr(kc), vc=_ptr(vc), o=_ptr(o), T=step.T, past=c.length,
                                   cap=c.capacity, ldo=H * hd), step.B * H)
    return run


def _bind_moe(exe: LLVMExecutor, n: Node):
    if n.weight("gate_up") is None:
        raise BackendError(f"moe_ffn %{n.id} has separate gate and up weights; the llvm backend needs the fused "
                           f"gate_up of the fuse pass — recompile the plan")
    gu_spec = exe.g.weight(n.weight("gate_up"))
    fmt, G = gu_spec.fmt, gu_spec.group_size
    E, I2, D = gu_spec.shape
    I = I2 // 2
    q8 = exe.act == "q8" and needs_q8(fmt, G)
    spec = MoESpec(fmt, D, I, G, q8, residual=len(n.args) == 3)
    ku = Kernel(exe.lib, moe_gate_up_gen(spec, exe.target))
    kd = Kernel(exe.lib, moe_down_gen(spec, exe.target))
    wu, su = exe._weight(n.weight("gate_up"))
    wd, sd = exe._weight(n.weight("down"))
    qx = exe.q8(D) if q8 else None
    qh = exe.q8(I) if q8 else None
    pad = (-(-max(D, I) // G) * G) if (G and not q8 and (D % G or I % G)) else 0

    def padded(a: np.ndarray, K: int) -> np.ndarray:
        if not pad or K % G == 0:
            return a
        out = np.zeros((a.shape[0], -(-K // G) * G), np.float32)
        out[:, :K] = a
        return out

    def run(step: Step) -> None:
        x, comb = step.env[n.args[0]], step.env[n.args[1]]
        tok, exp = np.nonzero(comb)                          # pairs, sorted by token
        order = np.argsort(exp, kind="stable")
        tok, exp = tok[order].astype(np.int64), exp[order].astype(np.int64)
        pw = np.ascontiguousarray(comb[tok, exp], np.float32)
        active, counts = np.unique(exp, return_counts=True)
        first = np.zeros(len(active) + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        active = active.astype(np.int64)
        P = len(tok)
        xd = xs = None
        xin = padded(x, D)
        if qx is not None:
            xin, xd, xs = qx(x)
        h = np.empty((P, I), np.float32)
        ku.launch(exe.pool, dict(h=_ptr(h), x=_ptr(xin), xd=_ptr(xd), xs=_ptr(xs), w=_ptr(wu), s=_ptr(su),
                                 pair_tok=_ptr(tok), first=_ptr(first), active=_ptr(active), ldx=xin.shape[1]),
                  len(active) * I, min_chunk=8)
        hd = hs = None
        hin = padded(h, I)
        if qh is not None:
            hin, hd, hs = qh(h)
        y = _out(step, n, D)
        r = step.env[n.args[2]] if len(n.args) == 3 else None
        kd.launch(exe.pool, dict(y=_ptr(y), r=_ptr(r), h=_ptr(hin), hd=_ptr(hd), hs=_ptr(hs), w=_ptr(wd), s=_ptr(sd),
                                 pair_tok=_ptr(tok), pair_exp=_ptr(exp), pair_w=_ptr(pw), P=P, M=step.M, ldy=D,
                                 ldr=D), D, min_chunk=16)
        del hin
    return run


def _bind_route(exe: LLVMExecutor, n: Node):
    E = n.type.shape[-1]
    k = Kernel(exe.lib, ew.route(E, n.attr("k"), bool(n.attr("norm")), exe.target))

    def run(step: Step) -> None:
        x = step.env[n.args[0]]
        y = _out(step, n, E)
        k.launch(exe.pool, dict(x=_ptr(x), y=_ptr(y), ldx=x.shape[1], ldy=E), step.M, min_chunk=16)
    return run


def _bind_binary(op: str):
    def bind(exe: LLVMExecutor, n: Node):
        C = n.type.shape[-1]
        a_cols, b_cols = (exe.g.node(a).type.shape[-1] for a in n.args)
        swap = a_cols != C                               # the kernel broadcasts its second operand
        bc = a_cols if swap else b_cols
        k = Kernel(exe.lib, ew.binary(op, C, bc, exe.target))

        def run(step: Step) -> None:
            a, b = step.env[n.args[0]], step.env[n.args[1]]
            if swap:
                a, b = b, a
            y = _out(step, n, C)
            k.launch(exe.pool, dict(a=_ptr(a), b=_ptr(b), y=_ptr(y), lda=a.shape[1], ldb=b.shape[1], ldy=C),
                     step.M, min_chunk=16)
        return run
    return bind


def _bind_unary(op: str):
    def bind(exe: LLVMExecutor, n: Node):
        C = n.type.shape[-1]
        k = Kernel(exe.lib, ew.unary(op, C, exe.target))
        lim = float_slot(n.attr("limit", 0.0))

        def run(step: Step) -> None:
            x = step.env[n.args[0]]
            y = _out(step, n, C)
            k.launch(exe.pool, dict(x=_ptr(x), y=_ptr(y), ldx=x.shape[1], ldy=C, limit=lim), step.M, min_chunk=16)
        return run
    return bind


def _bind_slice(exe: LLVMExecutor, n: Node):
    start, stop = n.attr("start"), n.attr("stop")
    k = Kernel(exe.lib, ew.slice_copy(start, stop, exe.target))

    def run(step: Step) -> None:
        x = step.env[n.args[0]]
        y = _out(step, n, stop - start)
        k.launch(exe.pool, dict(x=_ptr(x), y=_ptr(y), ldx=x.shape[1], ldy=stop - start), step.M, min_chunk=16)
    return run


_BINDERS: dict[Op, Callable[[LLVMExecutor, Node], Callable[[Step], None]]] = {
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
}
