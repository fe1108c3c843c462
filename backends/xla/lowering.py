"""The xla backend's op lowerings: each kernel-level op as JAX inside the traced forward function
(moe_ffn: moe.py). A decode step's dense int4 projections, the router and the attention go to
the Pallas kernels where they apply (pallas_dense.py, pallas_attn.py), with the RMS norm before
them and the residual add after them folded in.

Legend: B batch, T tokens per sequence, M = B*T, D hidden, H/KV heads, hd head dim, E experts,
k experts per token, S = cache capacity.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from strata_compiler.ir import Graph, Node, Op
from strata_compiler.rope import rope_inv_freq

from . import pallas_attn, pallas_dense, pallas_flash
from .context import _Ctx
from .dequant import MATVEC_ROWS, dequantize, matvec, silu
from .moe import moe_ffn
from .pallas_quant import fusable_norm


def _embed(c, n: Node, a):
    """Gather the stored rows first, then decode only those (the table may be quantized)."""
    spec = c.exe.g.weight(n.weight("table"))
    rows = {k: v[a[0]] for k, v in c.params[spec.name].items()}
    return dequantize(c.jnp, spec, rows, c.jnp.float32)


def _rms(jnp, x, w, eps, group=0):
    shape = x.shape
    if group:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    y = x * (1.0 / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))
    return (y * w).reshape(shape)


def _rms_node(c, n: Node, a: list):
    w, eps = c.w(n, "w", c.jnp.float32), n.attr("eps")
    if not n.attr("group", 0):      # consumers with a norm prologue read the input instead (norms)
        c.norms[n.id] = (w, eps, a[0])
    return _rms(c.jnp, a[0], w, eps, n.attr("group", 0))


def _linear(c: _Ctx, n: Node, a: list):
    jnp = c.jnp
    x = a[0]
    rms = n.attr("prologue", "none") == "rms_norm"
    rows = x.shape[0]
    name = n.weight("w")
    spec = c.exe.g.weight(name)
    # the norm a kernel can take as its prologue: the linear's own, or a standalone norm's (then
    # the kernel reads the norm's input: the norm itself is left unused)
    norm = (c.w(n, "norm", jnp.float32), n.attr("eps"), x) if rms else c.norms.get(n.args[0])
    y = _linear_kernel(c, n, a, spec, norm)
    if y is not None:
        return y
    if n.id in c.partials and norm is not None:
        # computed as the o projection's epilogue; these logits are for the XLA routing path only
        # (XLA drops them when the MoE kernels read the partials themselves)
        z = c.partials[n.id].sum(axis=1)[:, :spec.shape[0]]
        return z * (1.0 / jnp.sqrt(jnp.mean(norm[2] * norm[2], axis=-1, keepdims=True) + norm[1]))
    if rows <= MATVEC_ROWS:
        dense, interpret = pallas_dense.use_dense(c.exe.on_gpu, spec, rows)
        if dense and norm is not None:     # the router after a norm: one kernel for both
            y = pallas_dense.dense_decode(norm[2], spec, c.params[name], norm[:2], interpret=interpret)
            return _linear_tail(c, n, a, y, False)
        # the norm's 1/rms scales the product instead of x: x * w fuses into the reduction
        if rms:
            x = x * c.w(n, "norm", jnp.float32)
        y = matvec(jnp, spec, c.params[name], x)
        if rms:
            y = y * (1.0 / jnp.sqrt(jnp.mean(a[0] * a[0], axis=-1, keepdims=True) + n.attr("eps")))
    else:
        if rms:
            x = _rms(jnp, x, c.w(n, "norm", jnp.float32), n.attr("eps"))
        y = c.matmul(x, c.w(n, "w"))
    return _linear_tail(c, n, a, y, False)


def _linear_kernel(c: _Ctx, n: Node, a: list, spec, norm):
    """The linear through `pallas_dense.linear_decode` when it applies (int4, few rows: the kernel
    takes the norm as its prologue and, with no bias or epilogue in between, the residual add as
    its epilogue, and for the projection before a MoE the router too), else None."""
    jnp, x = c.jnp, a[0]
    kernel, interpret = pallas_dense.use_linear(c.exe.on_gpu, spec, x.shape[0])
    if not kernel or not (norm is None or fusable_norm(spec)):
        return None
    plain = n.weight("b") is None and n.attr("epilogue", "none") == "none"
    res = a[1] if len(a) == 2 and plain else None
    args = dict(interpret=interpret, rms=norm[:2] if norm is not None else None, residual=res)
    xin = x if norm is None else norm[2]
    router = c.exe.router_after.get(n.id) if res is not None else None
    if router is not None:
        rn, nn = (c.exe.g.node(i) for i in router)
        rspec = c.exe.g.weight(rn.weight("w"))
        if pallas_dense.router_fusable(spec, rspec) and pallas_dense.use_dense(c.exe.on_gpu, rspec, x.shape[0])[0]:
            # the o projection with the MoE's router as its epilogue: no router kernel
            y, c.partials[rn.id] = pallas_dense.linear_decode(
                xin, spec, c.params[spec.name], router=(rspec, c.params[rspec.name], c.w(nn, "w", jnp.float32)),
                **args)
            return _linear_tail(c, n, a, y, True)
    y = pallas_dense.linear_decode(xin, spec, c.params[spec.name], **args)
    return _linear_tail(c, n, a, y, res is not None)


def _linear_tail(c: _Ctx, n: Node, a: list, y, added: bool):
    """Bias, epilogue and residual of a linear after its product y (added: the residual is in y)."""
    jnp = c.jnp
    b = c.w(n, "b", jnp.float32)
    if b is not None:
        y = y + b
    if n.attr("epilogue", "none") == "silu_mul":
        half = y.shape[-1] // 2
        y = silu(jnp, y[..., :half]) * y[..., half:]
    if len(a) == 2 and not added:
        y = y + a[1]
    return y


def _rope(jnp, x, pos, hd, inv):
    """x [B, T, n, hd], rotate-half RoPE of row b's token t at position pos[b] + t (pos f32[B])."""
    T = x.shape[1]
    freqs = (pos[:, None] + jnp.arange(T, dtype=jnp.float32)[None, :])[..., None] * inv      # [B, T, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[:, :, None, :], jnp.sin(emb)[:, :, None, :]
    half = hd // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def _cache_write(lax, jnp, cache, new, pos):
    """new [B, KV, T, hd] into the cache [Bc >= B, KV, S, hd] (rows [0, B) are the step's) at each
    row's positions pos[b] + [0, T):
    one slice update where the rows are uniform (T > 1 needs them: KVCache.positions; B == 1),
    else (ragged decode) a scatter of each row's one new entry (indices (b, pos[b]): sorted,
    unique, in bounds: KVCache.positions checked the capacity)."""
    new = new.astype(cache.dtype)
    B, T = new.shape[0], new.shape[2]
    if T > 1 or B == 1:
        return lax.dynamic_update_slice(cache, new, (0, 0, pos[0], 0))
    return cache.at[jnp.arange(B), :, pos].set(new[:, :, 0], indices_are_sorted=True, unique_indices=True,
                                               mode="promise_in_bounds")


def _attention(c: _Ctx, n: Node, a: list):
    jnp, lax = c.jnp, c.jax.lax
    H, KV, hd = n.attr("n_heads"), n.attr("n_kv_heads"), n.attr("head_dim")
    B, T = c.B, c.T
    qkv = a[0].reshape(B, T, -1)
    q, k, v = qkv[..., :H * hd], qkv[..., H * hd:(H + KV) * hd], qkv[..., (H + KV) * hd:]
    mode = n.attr("qk_norm")
    layer = n.attr("layer")
    kernel, interpret = pallas_attn.use(c.exe.on_gpu, H, KV, hd, T, c.ks[layer].shape[2])
    if kernel:
        # decode on a GPU: norms, RoPE, the cache write and the attention in one Pallas kernel
        out, c.ks[layer], c.vs[layer] = pallas_attn.attention_decode(
            a[0].reshape(B, -1), c.pos, c.ks[layer], c.vs[layer], H=H, KV=KV, hd=hd, norm=mode,
            q_norm=c.w(n, "q_norm", jnp.float32) if mode != "none" else None,
            k_norm=c.w(n, "k_norm", jnp.float32) if mode != "none" else None, eps=n.attr("eps", 1e-6),
            clip=n.attr("clip_qkv") if n.has_attr("clip_qkv") else None,
            inv_freq=rope_inv_freq(hd, dict(n.attrs)), interpret=interpret)
        return out
    if mode != "none":
        g = hd if mode == "head" else 0
        q = _rms(jnp, q, c.w(n, "q_norm", jnp.float32), n.attr("eps"), g)
        k = _rms(jnp, k, c.w(n, "k_norm", jnp.float32), n.attr("eps"), g)
    if n.has_attr("clip_qkv"):
        lim = n.attr("clip_qkv")
        q, k, v = (jnp.clip(t, -lim, lim) for t in (q, k, v))
    inv = jnp.asarray(rope_inv_freq(hd, dict(n.attrs)))
    posf = c.pos.astype(jnp.float32)
    q = _rope(jnp, q.reshape(B, T, H, hd), posf, hd, inv)
    k = _rope(jnp, k.reshape(B, T, KV, hd), posf, hd, inv)
    v = v.reshape(B, T, KV, hd)
    K = _cache_write(lax, jnp, c.ks[layer], k.transpose(0, 2, 1, 3), c.pos)
    V = _cache_write(lax, jnp, c.vs[layer], v.transpose(0, 2, 1, 3), c.pos)
    c.ks[layer], c.vs[layer] = K, V
    dt = _attention_dtype(c, n)
    flash, interpret = pallas_flash.use(c.exe.on_gpu, H, KV, hd, T, K.shape[2])
    if flash:       # a prefill step on a GPU: flash attention, no [T, S] scores in memory
        return pallas_flash.attention(q, K, V, c.pos, dt, interpret).reshape(B * T, H * hd)
    if K.shape[0] != B:         # the step's rows of a larger batch cache (continuous batching)
        K, V = K[:B], V[:B]
    if T == 1 and c.span is not None and c.span < K.shape[2]:     # keys past every row's position: not read
        K, V = K[:, :, :c.span], V[:, :, :c.span]
    S = K.shape[2]
    rep = H // KV
    qg = q.reshape(B, T, KV, rep, hd).transpose(0, 2, 3, 1, 4)               # [B, KV, rep, T, hd]
    # operands in the plan's compute dtype (bf16 on a GPU for quantized weights: the tensor cores),
    # sums in f32
    prec = lax.Precision.HIGHEST if dt == jnp.float32 else None
    scores = jnp.einsum("bgrtd,bgsd->bgrts", qg.astype(dt), K.astype(dt), precision=prec,
                        preferred_element_type=jnp.float32) / np.float32(np.sqrt(hd))
    # causal over the cache, per row: row b's token t sees keys [0, pos[b] + t]
    allowed = jnp.arange(S)[None, None, :] <= (c.pos[:, None] + jnp.arange(T)[None, :])[..., None]   # [B, T, S]
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    p = c.jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bgrts,bgsd->bgrtd", p.astype(dt), V.astype(dt), precision=prec,
                     preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(B * T, H * hd)


def _attention_dtype(c: _Ctx, n: Node):
    """The dtype attention's products take: that of the projection that made q, k and v."""
    src = c.exe.g.node(n.args[0])
    w = src.weight("w") if src.op is Op.LINEAR else None
    return c.exe.compute_dtype(c.exe.g.weight(w)) if w is not None else c.jnp.float32


def _route(c: _Ctx, n: Node, a: list):
    p = c.jax.nn.softmax(a[0], axis=-1)
    vals, idx = c.jax.lax.top_k(p, n.attr("k"))          # ties: the lower index first, as the reference
    if n.attr("norm"):
        vals = vals / vals.sum(axis=-1, keepdims=True)
    c.topk[n.id] = vals, idx                             # for the moe_ffn it feeds: no second top_k
    # for decode kernels that route themselves (from the o projection's partials when it made them)
    c.logits[n.id] = a[0], n.attr("k"), bool(n.attr("norm")), c.partials.get(_router_of(c.exe.g, n))
    E = p.shape[-1]
    return (c.jax.nn.one_hot(idx, E, dtype=p.dtype) * vals[..., None]).sum(axis=-2)


OPS: dict[Op, Callable[[_Ctx, Node, list], object]] = {
    Op.EMBED: _embed,
    Op.RMS_NORM: _rms_node,
    Op.LINEAR: _linear,
    Op.FUSED_ATTENTION: _attention,
    Op.ROUTE: _route,
    Op.MOE_FFN: moe_ffn,
    Op.ADD: lambda c, n, a: a[0] + a[1],
    Op.MUL: lambda c, n, a: a[0] * a[1],
    Op.SILU: lambda c, n, a: silu(c.jnp, a[0]),
    Op.SIGMOID: lambda c, n, a: c.jax.nn.sigmoid(a[0]),
    Op.CLAMP: lambda c, n, a: c.jnp.clip(a[0], -n.attr("limit"), n.attr("limit")),
    Op.SLICE: lambda c, n, a: a[0][..., n.attr("start"):n.attr("stop")],
    Op.TRANSFER: lambda c, n, a: c.jnp.asarray(a[0], c.jnp.float32).reshape(-1, a[0].shape[-1]),
}


def routers_after(graph: Graph, users: dict, ids: set) -> dict[int, tuple[int, int]]:
    """linear node id -> (router linear, rms_norm) for each projection whose output (with its
    residual add) feeds, through an RMS norm, a dense router linear whose logits a route ranks
    (`_router_of`), all in this computation: the decode kernels can then compute the router as
    that projection's epilogue (`linear_decode(router=)`)."""
    def plain(n: Node) -> bool:
        return (n.op is Op.LINEAR and n.weight("b") is None and n.attr("epilogue", "none") == "none"
                and n.attr("prologue", "none") == "none")

    routers = {_router_of(graph, n) for n in graph.nodes if n.id in ids and n.op is Op.ROUTE}
    out = {}
    for n in graph.nodes:
        if n.id not in ids or not plain(n) or len(n.args) != 2:
            continue
        for r in (graph.node(u) for u in users[n.id] if u in ids):
            if r.op is not Op.RMS_NORM or r.attr("group", 0):
                continue
            for lin in (graph.node(u) for u in users[r.id] if u in ids):
                if plain(lin) and len(lin.args) == 1 and lin.id in routers:
                    out[n.id] = (lin.id, r.id)
    return out


def _router_of(graph: Graph, route: Node) -> int:
    """The node whose logits a route op ranks: its argument, or the argument of a slice from column
    0 before it (a router fused with a shared expert's gate, as Qwen2-MoE's: [E + 1] columns)."""
    src = graph.node(route.args[0])
    if src.op is Op.SLICE and src.attr("start") == 0:
        return src.args[0]
    return src.id

