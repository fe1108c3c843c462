"""The xla backend's lowering of moe_ffn: the Pallas decode kernels (pallas_moe.py) where they
apply, else one of XLA's paths by the number of (token, expert) pairs: a fused multiply-reduce
over the chosen experts' packed weights (decode), experts sliced one by one, the chosen experts
gathered, or (prefill) the pairs grouped by expert into ragged matmuls. An expert cache's GPU
share reads a resident expert from its slot and the others from host memory in place.

Legend: M tokens, D hidden, E experts, k experts per token, I expert intermediate.
"""

from __future__ import annotations

from strata_compiler.ir import Node

from . import pallas_gemm, pallas_moe
from .context import _Ctx
from .dequant import MATVEC_ROWS, dequantize, matvec, silu
from .pallas_quant import fusable_norm

SLICE_PAIRS = 16   # up to this many (token, expert) pairs, the XLA path slices experts one by one


def moe_ffn(c: _Ctx, n: Node, a: list):
    """A moe_ffn node: the whole layer, a share of its experts (own top-k over their routing
    columns), or an expert cache's side, each through `moe_core`."""
    jnp, jax = c.jnp, c.jax
    x, comb = a[0], a[1]
    k = c.exe.route_k[n.id]
    whole = c.exe.miss_source.get(n.id)
    if whole is not None:
        return _moe_cached(c, n, a, whole)
    if n.id in c.exe.silent:    # a cache's host share whose misses the GPU share reads in place
        out = jnp.zeros((x.shape[0], c.exe.g.weight(n.weight("down")).shape[1]), jnp.float32)
        return out if len(a) < 3 else out + a[2]
    gu_spec = c.exe.g.weight(n.weight("gate_up"))
    dn_spec = c.exe.g.weight(n.weight("down"))
    dt = c.exe.compute_dtype(gu_spec)
    ids = n.attr("experts", ())
    live = c.ext.get(-(n.id + 1)) if n.attr("cache", "") else None
    if ids:   # a share of the layer's experts: their routing columns (a cache's: its slots'), own top-k
        comb = comb[:, live if live is not None else jnp.asarray(ids)]
        k = min(k, comb.shape[1])
        topw, topi = jax.lax.top_k(comb, k)
    elif n.attr("cache", ""):   # an expert cache's host side, run here: the plan's non-resident experts
        from strata_compiler.experts import nonresident_mask

        comb = comb * jnp.asarray(nonresident_mask(c.exe.g, n, c.exe.residency))
        topw, topi = jax.lax.top_k(comb, k)
    else:     # [M, k], in top_k(comb)'s order: the route's own, when it ran in this computation
        topw, topi = c.topk.get(n.args[1]) or jax.lax.top_k(comb, k)
    gu_p, dn_p = c.params[n.weight("gate_up")], c.params[n.weight("down")]
    route = None if ids or n.attr("cache", "") else c.logits.get(n.args[1])
    return moe_core(c, x, topw, topi, gu_spec, gu_p, dn_spec, dn_p, dt, route=route, norm=c.norms.get(n.args[0]),
                    residual=a[2] if len(a) == 3 else None)


def _moe_cached(c: _Ctx, n: Node, a: list, whole: Node):
    """An expert cache's GPU share that computes the whole layer (`--miss-path gpu`,
    runtime/mapped.py): each chosen expert's weights from its slot when resident, else from the
    host share's whole arrays, which on a GPU are host memory read in place over PCIe. Records
    the step's routings per expert (c.counts) for the cache's bookkeeping."""
    jnp, jax = c.jnp, c.jax
    x, comb = a[0], a[1]
    g = c.exe.g
    gu_spec, dn_spec = g.weight(whole.weight("gate_up")), g.weight(whole.weight("down"))
    live = c.ext.get(-(n.id + 1))                    # slot -> expert, int32 [S]
    if live is None:                                 # no live cache: the plan's slots
        live = jnp.asarray(n.attr("experts")[:c.exe.slots_of[n.id]], jnp.int32)
    E = comb.shape[1]
    # a slot whose expert is being swapped holds -1 (FusedStep.launch): no expert reads it
    slot_of = jnp.full((E,), -1, jnp.int32).at[jnp.where(live >= 0, live, E)].set(
        jnp.arange(live.shape[0], dtype=jnp.int32), mode="drop")
    topw, topi = c.topk.get(n.args[1]) or jax.lax.top_k(comb, c.exe.route_k[n.id])
    out, ids = moe_core(c, x, topw, topi, gu_spec, c.params[whole.weight("gate_up")], dn_spec,
                        c.params[whole.weight("down")], c.exe.compute_dtype(gu_spec), route=c.logits.get(n.args[1]),
                        norm=c.norms.get(n.args[0]), residual=a[2] if len(a) == 3 else None,
                        slots=(slot_of, c.params[n.weight("gate_up")], c.params[n.weight("down")]))
    c.counts[n.id] = jnp.zeros((E,), jnp.int32).at[ids.reshape(-1)].add(1)
    return out


def gemm(c: _Ctx, gu_spec, dn_spec, M: int, pallas_ok: bool, slots) -> bool:
    """Whether a MoE of M tokens runs on pallas_gemm's grouped kernels (above the decode kernels'
    rows; not for an expert cache's slots)."""
    above = pallas_moe.max_rows() if pallas_moe.supported(gu_spec, dn_spec) else 0
    return (pallas_ok and slots is None and pallas_gemm.use(c.exe.on_gpu, gu_spec, M, above)[0]
            and pallas_gemm.use(c.exe.on_gpu, dn_spec, M, above)[0])


def moe_core(c: _Ctx, x, topw, topi, gu_spec, gu_p, dn_spec, dn_p, dt, pallas_ok: bool = True, route=None,
             norm=None, residual=None, slots=None):
    """sum_j topw[m, j] * expert_{topi[m, j]}(x[m]) over the stacked experts gu_p / dn_p (their
    arrays by name, specs' formats), f32 [M, D], plus `residual` when given. route: (logits, k,
    renormalise, partials or None) of the route op that gave topw/topi, when it ran in this
    computation (the decode kernels then route inside; partials: its router's logits as the o
    projection's epilogue left them, `pallas_dense.linear_decode(router=)`). norm: (weight, eps,
    input) of the RMS norm that gave x, which the decode kernels can take over with the residual
    add (dp4a: the norm in gate_up, the add in down). slots (slot_of int32 [E], gate_up's and
    down's slot arrays): an expert cache's GPU slots, where the decode paths read a resident
    expert instead of gu_p / dn_p (then the whole layer in host memory, read in place); the
    others read gu_p / dn_p, which hold every expert. With slots: (result, the chosen experts
    int32 [M*k])."""
    jnp, jax = c.jnp, c.jax
    M, D = x.shape
    k = topi.shape[1]
    ids = topi.reshape(-1)

    def done(out):
        out = out if residual is None else out + residual
        return out if slots is None else (out, ids)

    E, I2, _ = gu_spec.shape
    I = I2 // 2
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    pallas, interpret = pallas_moe.use(c.exe.on_gpu, gu_spec, dn_spec, M) if pallas_ok else (False, False)
    w = (gu_spec, gu_p, dn_spec, dn_p)
    if pallas:
        out, added = _pallas_decode(x, topi, topw, *w, interpret, route, norm, residual, slots)
        if slots is not None:
            out, ids = out
        if added:     # (down added the residual)
            return out if slots is None else (out, ids)
    elif gemm(c, gu_spec, dn_spec, M, pallas_ok, slots):
        # prefill and batched decode on a GPU: the pairs grouped by expert into row blocks, tensor-
        # core kernels over the packed weights
        out = pallas_gemm.moe(x, topi, topw, gu_spec, gu_p, dn_spec, dn_p, dtype=jnp.dtype(dt).name,
                              interpret=pallas_gemm.use(c.exe.on_gpu, gu_spec, M, 0)[1])
    elif M <= MATVEC_ROWS:
        out = _fused_matvec(jnp, x, topi, topw, *w, I, slots)
    elif M * k <= SLICE_PAIRS:
        out = _sliced(jnp, jax, x, topi, topw, *w, I, dt, prec)
    elif M * k <= E:
        out = _gathered(jnp, x, topi, topw, *w, I, dt, prec)
    else:
        out = _grouped(jnp, jax, x, topi, topw, *w, I, dt, prec)
    return done(out)


def _pallas_decode(x, topi, topw, gu_spec, gu_p, dn_spec, dn_p, interpret, route, norm, residual, slots):
    """decode, int4/int8 experts on a GPU: two Pallas kernels (gate/up + silu*mul; down + weighted
    combine) over the stored packed weights. (moe_decode's result, whether down added residual)."""
    kw = {}
    if norm is not None and fusable_norm(gu_spec):
        # the norm as gate_up's prologue, the residual add (when it is the MoE's) as down's epilogue
        x, kw = norm[2], dict(rms=norm[:2], residual=residual)
    cached = dict(slots=slots, with_ids=True) if slots is not None else {}
    if route is not None:
        # softmax and top-k in gate_up: no routing kernels; from the router's partial sums
        # when the o projection left them (and gate_up takes the norm)
        E = gu_spec.shape[0]
        src = dict(partials=route[3], n_experts=E) if route[3] is not None and kw else dict(logits=route[0])
        out = pallas_moe.moe_decode(x, None, None, gu_spec, gu_p, dn_spec, dn_p, interpret=interpret,
                                    k=route[1], norm=route[2], **src, **kw, **cached)
    else:
        out = pallas_moe.moe_decode(x, topi, topw, gu_spec, gu_p, dn_spec, dn_p, interpret=interpret, **kw,
                                    **cached)
    return out, bool(residual is not None and kw)


def _fused_matvec(jnp, x, topi, topw, gu_spec, gu_p, dn_spec, dn_p, I: int, slots):
    """decode: one fused multiply-reduce per projection over all chosen experts (the gather of
    their packed weights happens inside the reduction, so nothing is copied); an expert cache's
    resident experts from their slots."""
    if slots is None:
        def sel(p, _s):
            return {r: v[topi] for r, v in p.items()}
        gu_s = dn_s = None
    else:
        hit, si = slots[0][topi] >= 0, jnp.maximum(slots[0][topi], 0)
        gu_s, dn_s = slots[1], slots[2]

        def sel(p, s):
            return {r: jnp.where(hit.reshape(hit.shape + (1,) * (v.ndim - 1)), s[r][si], v[topi])
                    for r, v in p.items()}
    gu = matvec(jnp, gu_spec, sel(gu_p, gu_s), x[:, None, :])                                   # [M, k, 2I]
    h = silu(jnp, gu[..., :I]) * gu[..., I:]
    y = matvec(jnp, dn_spec, sel(dn_p, dn_s), h)                                                # [M, k, D]
    return (y * topw[..., None]).sum(axis=1)


def _sliced(jnp, jax, x, topi, topw, gu_spec, gu_p, dn_spec, dn_p, I: int, dt, prec):
    """decode: each chosen expert's weights as a dynamic slice of the stacked array, read in place
    (a gather would first copy k experts' weights: slower)."""
    M, D = x.shape
    out = jnp.zeros((M, D), jnp.float32)
    for m in range(M):
        for j in range(topi.shape[1]):
            e = topi[m, j]
            gu = dequantize(jnp, gu_spec, {r: jax.lax.dynamic_index_in_dim(v, e, 0, keepdims=False)
                                           for r, v in gu_p.items()}, dt)                 # [2I, D]
            h = jnp.dot(gu, x[m].astype(dt), precision=prec, preferred_element_type=jnp.float32)
            h = silu(jnp, h[:I]) * h[I:]
            dn = dequantize(jnp, dn_spec, {r: jax.lax.dynamic_index_in_dim(v, e, 0, keepdims=False)
                                           for r, v in dn_p.items()}, dt)                 # [D, I]
            y = jnp.dot(dn, h.astype(dt), precision=prec, preferred_element_type=jnp.float32)
            out = out.at[m].add(topw[m, j] * y)
    return out


def _gathered(jnp, x, topi, topw, gu_spec, gu_p, dn_spec, dn_p, I: int, dt, prec):
    """few tokens: gather just the chosen experts' packed weights, then dequantize those."""
    gu = dequantize(jnp, gu_spec, {r: v[topi] for r, v in gu_p.items()}, dt)           # [M, k, 2I, D]
    h = jnp.einsum("md,mkid->mki", x.astype(dt), gu, precision=prec, preferred_element_type=jnp.float32)
    h = silu(jnp, h[..., :I]) * h[..., I:]
    dn = dequantize(jnp, dn_spec, {r: v[topi] for r, v in dn_p.items()}, dt)            # [M, k, D, I]
    y = jnp.einsum("mki,mkdi->mkd", h.astype(dt), dn, precision=prec, preferred_element_type=jnp.float32)
    return (y * topw[..., None]).sum(axis=1)


def _grouped(jnp, jax, x, topi, topw, gu_spec, gu_p, dn_spec, dn_p, I: int, dt, prec):
    """many tokens: group the (token, expert) pairs by expert, one ragged matmul per projection."""
    M, D = x.shape
    E, k = gu_spec.shape[0], topi.shape[1]
    flat = topi.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x[tok].astype(dt)
    gu = dequantize(jnp, gu_spec, gu_p, dt).transpose(0, 2, 1)                       # [E, D, 2I]
    h = jax.lax.ragged_dot(xs, gu, sizes, precision=prec, preferred_element_type=jnp.float32)
    h = silu(jnp, h[:, :I]) * h[:, I:]
    dn = dequantize(jnp, dn_spec, dn_p, dt).transpose(0, 2, 1)                       # [E, I, D]
    ys = jax.lax.ragged_dot(h.astype(dt), dn, sizes, precision=prec, preferred_element_type=jnp.float32)
    # back to (token, choice) order, then a weighted sum over the k choices: a scatter-add into
    # the tokens' rows would accumulate in whatever order the GPU's atomics land, not the same
    # from run to run
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return (ys[back].reshape(M, k, D) * topw[..., None]).sum(axis=1)
