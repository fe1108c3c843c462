"""The NumPy reference backend: an interpreter of tensor- and kernel-level IR.

It is the semantic oracle: every other backend and every pass is checked against it, so it
favours clarity over speed and computes in f32 with weights dequantized once.

Legend: B = batch, T = tokens in this step, D = hidden, H = query heads, KV = kv heads,
hd = head dim, E = experts, I = intermediate, S = cached + new tokens.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from strata_compiler.errors import BackendError
from strata_compiler.execution import WHOLE, Executor, Segment
from strata_compiler.experts import Residency, nonresident_mask
from strata_compiler.ir import Graph, Node, Op
from strata_compiler.kv_cache import KVCache
from strata_compiler.rope import rope_cos_sin
from strata_compiler.verify import check_token_ids


class WeightSource(Protocol):
    def get(self, name: str) -> np.ndarray: ...   # the weight dequantized to f32, logical shape


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float, group: int = 0) -> np.ndarray:
    shape = x.shape
    if group:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    y = x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)))
    return (y * w).reshape(shape).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):    # exp(-x) = inf for x << 0 gives the right limit, 0
        return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def topk_mask(p: np.ndarray, k: int) -> np.ndarray:
    """Zero all but the k largest entries of the last axis (ties: the lower index wins)."""
    idx = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    out = np.zeros_like(p)
    np.put_along_axis(out, idx, np.take_along_axis(p, idx, axis=-1), axis=-1)
    return out


def rope(x: np.ndarray, positions: np.ndarray, head_dim: int, attrs: dict) -> np.ndarray:
    """positions i64[B, T] (each row its own)."""
    B, T, C = x.shape
    cos, sin = rope_cos_sin(positions, head_dim, attrs)           # [B, T, hd]
    h = x.reshape(B, T, C // head_dim, head_dim)
    half = head_dim // 2
    rot = np.concatenate([-h[..., half:], h[..., :half]], axis=-1)
    return (h * cos[:, :, None, :] + rot * sin[:, :, None, :]).reshape(B, T, C).astype(np.float32)


def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache, layer: int,
         H: int, KV: int, hd: int) -> np.ndarray:
    """Causal attention of the T new tokens over the cache plus themselves (GQA: H/KV groups); each
    row at its own position (the cache's lengths)."""
    B, T, _ = q.shape
    qh = q.reshape(B, T, H, hd).transpose(0, 2, 1, 3)               # [B, H, T, hd]
    kh = k.reshape(B, T, KV, hd).transpose(0, 2, 1, 3)
    vh = v.reshape(B, T, KV, hd).transpose(0, 2, 1, 3)
    past = cache.positions(T)                                        # [B]
    ks, vs = cache.append(layer, kh, vh)                             # [B, KV, S, hd]
    S = ks.shape[2]
    rep = H // KV
    ks, vs = np.repeat(ks, rep, axis=1), np.repeat(vs, rep, axis=1)  # [B, H, S, hd]
    scores = qh @ ks.transpose(0, 1, 3, 2) / np.float32(np.sqrt(hd))  # [B, H, T, S]
    mask = np.arange(S)[None, None, :] > (past[:, None] + np.arange(T))[:, :, None]   # [B, T, S]: key after query
    scores = np.where(mask[:, None], -np.inf, scores)
    out = softmax(scores) @ vs                                       # [B, H, T, hd]
    return out.transpose(0, 2, 1, 3).reshape(B, T, H * hd).astype(np.float32)


def moe_ffn(x: np.ndarray, combine: np.ndarray, gate_up: Callable[[int], tuple[np.ndarray, np.ndarray]],
            down: Callable[[int], np.ndarray], observe: Callable | None = None) -> np.ndarray:
    """sum_e combine[..., e] * down_e(silu(gate_e x) * up_e x), over the experts some token chose.
    `observe(e, x_rows, h_rows, weights)`, when given, sees each expert's inputs (calibration)."""
    B, T, D = x.shape
    xf, cf = x.reshape(B * T, D), combine.reshape(B * T, -1)
    y = np.zeros_like(xf)
    for e in np.nonzero(cf.any(axis=0))[0]:
        rows = np.nonzero(cf[:, e])[0]
        g, u = gate_up(int(e))
        h = silu(xf[rows] @ g.T) * (xf[rows] @ u.T)
        if observe is not None:
            observe(int(e), xf[rows], h, cf[rows, e])
        y[rows] += cf[rows, e:e + 1] * (h @ down(int(e)).T)
    return y.reshape(B, T, D)


class ReferenceExecutor(Executor):
    """Runs one step (prefill chunk or decode) of a tensor- or kernel-level graph.

    An `observer` (the calibration probe's recorder) is shown the input of every matrix
    product: observer.matmul(node, x) with x the rows the weight multiplies, and
    observer.expert(node, e, x, h, weights) for each expert of a moe_ffn; an observer with a
    `route` method also gets observer.route(node, combine) with each moe_ffn's routing weights
    [B, T, E] (zero for the experts a token did not choose)."""

    def __init__(self, graph: Graph, weights: WeightSource, observer=None, residency: Residency | None = None,
                 nodes: list[int] | None = None) -> None:
        self.g = graph
        self.part = [n.id for n in graph.nodes] if nodes is None else list(nodes)    # run_segment's nodes
        self.w = weights
        self.observer = observer
        self.residency = residency     # the live expert caches of a mixed run (else the plan's split)
        last_use: dict[int, int] = {}
        for i, n in enumerate(graph.nodes):
            for a in n.args:
                last_use[a] = i
        self.frees = [[a for a in dict.fromkeys(n.args) if last_use[a] == i] for i, n in enumerate(graph.nodes)]
        for n in graph.nodes:
            if n.op not in _HANDLERS:
                raise BackendError(f"reference backend has no kernel for op {n.op.value}")

    def run(self, input_ids: np.ndarray, cache: KVCache, last_only: bool = False) -> dict[int, np.ndarray]:
        # overflow in a broken plan's numbers is reported once, as non-finite logits (runtime),
        # not as NumPy's warnings on stderr
        with np.errstate(all="ignore"):
            return self._run(input_ids, cache)

    keep: frozenset = frozenset()       # node ids whose values a step leaves in `kept` (per-layer eval)
    inject: dict = {}                   # node id -> the value to use instead of computing it

    def _run(self, input_ids: np.ndarray, cache: KVCache) -> dict[int, np.ndarray]:
        T = input_ids.shape[1]
        self.kept: dict[int, np.ndarray] = {}
        ctx = _Step(self.w, cache, cache.positions(T)[:, None] + np.arange(T), input_ids, self.observer)
        ctx.graph, ctx.residency = self.g, self.residency
        env: dict[int, np.ndarray] = {}
        outputs = set(self.g.outputs)
        for i, n in enumerate(self.g.nodes):
            value = _HANDLERS[n.op](ctx, n, [env[a] for a in n.args])
            env[n.id] = self.inject.get(n.id, value)
            if n.id in self.keep:
                self.kept[n.id] = np.array(env[n.id])
            for a in self.frees[i]:
                if a not in outputs:
                    del env[a]
        cache.advance(T)
        return {o: env[o] for o in self.g.outputs}

    def run_segment(self, env: dict, input_ids: np.ndarray, cache: KVCache, seg: Segment = WHOLE) -> None:
        """Run this partition's nodes (a mixed plan's; `seg` [lo, hi) of them), reading and writing
        the shared env."""
        B, T = input_ids.shape
        ctx = _Step(self.w, cache, cache.positions(T)[:, None] + np.arange(T), input_ids, self.observer)
        ctx.graph, ctx.residency = self.g, self.residency
        for nid in self.part[seg.lo:seg.hi]:
            n = self.g.node(nid)
            args = [np.asarray(env[a]).reshape(B, T, -1) if self.g.node(a).op is not Op.INPUT_IDS else env[a]
                    for a in n.args]
            env[n.id] = _HANDLERS[n.op](ctx, n, args)


class _Step:
    def __init__(self, w: WeightSource, cache: KVCache, positions: np.ndarray, ids: np.ndarray, observer=None) -> None:
        self.w, self.cache, self.positions, self.ids = w, cache, positions, ids
        self.observer = observer

    def weight(self, n: Node, role: str) -> np.ndarray | None:
        name = n.weight(role)
        return None if name is None else self.w.get(name)


def _matmul(c: _Step, n: Node, a: list) -> np.ndarray:
    if c.observer is not None:
        c.observer.matmul(n, a[0])
    y = a[0] @ c.weight(n, "w").T
    b = c.weight(n, "b")
    return (y + b if b is not None else y).astype(np.float32)


def _linear(c: _Step, n: Node, a: list) -> np.ndarray:
    x = a[0]
    if n.attr("prologue", "none") == "rms_norm":
        x = rms_norm(x, c.weight(n, "norm"), n.attr("eps"))
    y = _matmul(c, n, [x])
    if n.attr("epilogue", "none") == "silu_mul":
        half = y.shape[-1] // 2
        y = silu(y[..., :half]) * y[..., half:]
    if len(a) == 2:
        y = y + a[1]
    return y.astype(np.float32)


def _attrs(n: Node) -> dict:
    return dict(n.attrs)


def _sdpa(c: _Step, n: Node, a: list) -> np.ndarray:
    return sdpa(a[0], a[1], a[2], c.cache, n.attr("layer"), n.attr("n_heads"), n.attr("n_kv_heads"), n.attr("head_dim"))


def _fused_attention(c: _Step, n: Node, a: list) -> np.ndarray:
    H, KV, hd = n.attr("n_heads"), n.attr("n_kv_heads"), n.attr("head_dim")
    qkv = a[0]
    q, k, v = qkv[..., :H * hd], qkv[..., H * hd:(H + KV) * hd], qkv[..., (H + KV) * hd:]
    mode = n.attr("qk_norm")
    if mode != "none":
        group = hd if mode == "head" else 0
        q = rms_norm(q, c.weight(n, "q_norm"), n.attr("eps"), group)
        k = rms_norm(k, c.weight(n, "k_norm"), n.attr("eps"), group)
    if n.has_attr("clip_qkv"):
        lim = n.attr("clip_qkv")
        q, k, v = (np.clip(t, -lim, lim) for t in (q, k, v))
    attrs = _attrs(n)
    q, k = rope(q, c.positions, hd, attrs), rope(k, c.positions, hd, attrs)
    return sdpa(q, k, v, c.cache, n.attr("layer"), H, KV, hd)


def _moe_ffn(c: _Step, n: Node, a: list) -> np.ndarray:
    down = c.weight(n, "down")
    if n.weight("gate_up") is not None:
        gu = c.weight(n, "gate_up")
        half = gu.shape[1] // 2
        pair = lambda e: (gu[e, :half], gu[e, half:])  # noqa: E731
    else:
        g, u = c.weight(n, "gate"), c.weight(n, "up")
        pair = lambda e: (g[e], u[e])  # noqa: E731
    obs = c.observer
    if obs is not None and hasattr(obs, "route"):
        obs.route(n, a[1])
    ids = n.attr("experts", ())
    route = a[1][..., list(ids)] if ids else a[1]   # a share of the layer's experts: their columns
    if n.attr("cache", "") and not ids:             # an expert cache's host side: the non-resident ones
        route = route * nonresident_mask(c.graph, n, c.residency)
    y = moe_ffn(a[0], route, pair, lambda e: down[e],
                None if obs is None else (lambda e, x, h, w: obs.expert(n, e, x, h, w)))
    return y + a[2] if len(a) == 3 else y


def _embed(c: _Step, n: Node, a: list) -> np.ndarray:
    """Rows of the table, the ids checked against its real row count first."""
    table = c.weight(n, "table")
    check_token_ids(a[0], table.shape[0], n.weight("table"))
    return table[a[0]]


def _route(c: _Step, n: Node, a: list) -> np.ndarray:
    m = topk_mask(softmax(a[0]), n.attr("k"))
    return m / m.sum(axis=-1, keepdims=True) if n.attr("norm") else m


_HANDLERS: dict[Op, Callable[[_Step, Node, list], np.ndarray]] = {
    Op.INPUT_IDS: lambda c, n, a: c.ids,
    Op.EMBED: _embed,
    Op.RMS_NORM: lambda c, n, a: rms_norm(a[0], c.weight(n, "w"), n.attr("eps"), n.attr("group", 0)),
    Op.MATMUL: _matmul,
    Op.ADD: lambda c, n, a: a[0] + a[1],
    Op.MUL: lambda c, n, a: a[0] * a[1],
    Op.SILU: lambda c, n, a: silu(a[0]),
    Op.SIGMOID: lambda c, n, a: sigmoid(a[0]),
    Op.SLICE: lambda c, n, a: np.ascontiguousarray(a[0][..., n.attr("start"):n.attr("stop")]),
    Op.CLAMP: lambda c, n, a: np.clip(a[0], -n.attr("limit"), n.attr("limit")),
    Op.ROPE: lambda c, n, a: rope(a[0], c.positions, n.attr("head_dim"), _attrs(n)),
    Op.SDPA: _sdpa,
    Op.SOFTMAX: lambda c, n, a: softmax(a[0]),
    Op.TOPK_MASK: lambda c, n, a: topk_mask(a[0], n.attr("k")),
    Op.RENORM: lambda c, n, a: a[0] / a[0].sum(axis=-1, keepdims=True),
    Op.MOE_FFN: _moe_ffn,
    Op.LINEAR: _linear,
    Op.ROUTE: _route,
    Op.FUSED_ATTENTION: _fused_attention,
    Op.TRANSFER: lambda c, n, a: a[0],
}
